"""The accuracy gate: statistics, error spending, policy, decisions, looks, levels, external runs and the record."""
