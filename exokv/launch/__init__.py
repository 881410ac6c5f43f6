"""Starting and minding the ranks: the mlx.launch command (`command`), commands on
other hosts over ssh (`remote`), the supervisor that starts, watches and ends the group
(`supervise`), the watcher each rank keeps of its front end (`watcher`), and
`exokv-launch`, mlx.launch with its relay paced (`paced`)."""
