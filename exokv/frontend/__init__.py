"""What the chat and the server share to start and to keep state: options checked and
placed, the store opened, the ranks started (`start`), a turn stored as it ends
(`hooks`), a stored session's settings (`resume`) and SIGTERM/SIGHUP (`signals`)."""
