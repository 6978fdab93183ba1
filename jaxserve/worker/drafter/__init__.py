"""Device drafters for speculative decoding (`self` and `draft_model`)."""
