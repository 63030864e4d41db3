"""KV-cache limits: kvcached's shared-memory segment protocol, the holding rules and the keeper."""
