"""One model over several hosts: the leader/follower engine, its control
channel and the typed encoding of scheduler outputs."""
