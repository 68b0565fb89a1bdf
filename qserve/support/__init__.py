"""What runs where: the support claims per device, the probe in vLLM behind them, and `qserve doctor`."""
