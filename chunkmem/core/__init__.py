"""What a chunk is: chunks and their copy states, the layout, the memory tiers, the byte ledger."""
