"""The wire both sides use: launching ranks with mlx.launch, the channel, the doorbell."""
