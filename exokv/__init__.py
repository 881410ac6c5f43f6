"""exokv: chat with a model split across several Macs, with a rank-coherent KV prefix cache."""

__version__ = "0.1.0"
