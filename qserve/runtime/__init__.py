"""The process qserve runs in: child processes, scratch space, captured output, priorities, memory."""
