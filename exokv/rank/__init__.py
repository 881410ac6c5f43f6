"""What runs on a rank: its main loop (`main`), one turn (`engine`), save and resume (`kvsave`)."""
