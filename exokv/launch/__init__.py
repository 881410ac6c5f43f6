"""Starting and minding the ranks: the mlx.launch command (`command`), commands on
other hosts over ssh (`remote`), the supervisor that starts, watches and ends the group
(`supervise`), and the watcher each rank keeps of its front end (`watcher`)."""
