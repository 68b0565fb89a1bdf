"""Commands over a checkpoint that draw on several parts: run, compare, reproduce, inspect, sign."""
