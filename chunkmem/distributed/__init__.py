"""Across ranks: collectives with bounded waits, the ranks' agreements, shard strategies."""
