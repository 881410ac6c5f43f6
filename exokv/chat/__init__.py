"""The chat front end: conversations, slash commands, script mode and the REPL."""
