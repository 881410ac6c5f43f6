"""Plain data every layer shares: the records that cross processes, the options the
ranks are started with, sizes as people write them, and the tables the commands print."""
