"""Ranks, the channel to the front end, and the collectives the engine uses."""
