"""exokv's state: one SQLite database under EXOKV_HOME, and the running-chat registry."""

from exokv.state.running import register_chat, running_chats
from exokv.state.store import DB_NAME, Store, caches_dir, clear_saved_caches, db_path

__all__ = [
    "DB_NAME",
    "Store",
    "caches_dir",
    "clear_saved_caches",
    "db_path",
    "register_chat",
    "running_chats",
]
