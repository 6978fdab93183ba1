"""The front end: requests in, outputs out. The async engine and its engine-loop
thread, request streams, intake checks, output processing, detokenizing,
stop strings, and the offline `LLM`."""
