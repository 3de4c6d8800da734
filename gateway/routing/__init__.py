"""Where a request goes: the block index, its Redis mirror, sessions, the pure router and the dispatcher."""
