"""The command line: the Typer app (`app`) and a module per command group (`bench`,
`cache`, `hosts`, `sessions`, `completion`). A command parses, calls a front end,
renders and returns an exit code; it computes nothing of its own."""
