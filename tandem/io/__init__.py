"""File formats and disk I/O: the disk tier's chunk and anchor files (tierfile), the hash chain
that names them (chain), the index of what is on disk (tierindex), the fingerprint of the
arithmetic that wrote them (fingerprint), O_DIRECT transfers (direct), what a prefill writes
(admission) and what the budget deletes (eviction)."""
