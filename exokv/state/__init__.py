"""exokv's state: one SQLite database under EXOKV_HOME, and the running-chat registry."""

from exokv.state.connection import DB_NAME, db_path
from exokv.state.running import register_chat, running_chats
from exokv.state.store import Store, caches_dir, clear_saved_caches

__all__ = [
    "DB_NAME",
    "Store",
    "caches_dir",
    "clear_saved_caches",
    "db_path",
    "register_chat",
    "running_chats",
]
