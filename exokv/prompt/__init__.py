"""What the model sees: a conversation rendered with its chat template (`render`), and
the marker messages that carry raw prompts and tool results through it (`markers`)."""
