"""Host KV bookkeeping: the block pool, the KV manager (the only writer of block
tables) and prefix hashes. No device arrays here."""
