"""The drain process: the loop (lead, select, forward, settle, wait) and its parts."""
