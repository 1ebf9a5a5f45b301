"""File formats and disk I/O: the disk tier's chunk and anchor files (tierfile), the hash chain
that names them (chain), the index of what is on disk (tierindex), the fingerprint of the
arithmetic that wrote them (fingerprint), and O_DIRECT transfers (direct)."""
