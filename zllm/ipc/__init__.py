"""Inter-process messages and the only code that turns them into bytes."""
