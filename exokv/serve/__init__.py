"""`exokv serve`: the ranks and their prefix cache behind an OpenAI-compatible HTTP API.

A second front end of the same client the chat uses (LocalClient or ClusterClient,
started by `exokv.frontend.start.started`): `api` reads and writes OpenAI's shapes (no I/O),
`work` feeds requests one at a time through a bounded queue into the client, `app`
is the Starlette application, `run` starts it all under uvicorn and drains on exit.
"""
