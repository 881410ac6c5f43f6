"""The bytes between the front end and rank 0: the authenticated channel (`channel`),
the typed messages both sides encode and decode (`messages`), and the doorbell that
wakes the other ranks (`wake`). Starting the ranks is exokv.launch."""
