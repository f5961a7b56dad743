"""The owner loop, worker threads, deadlines and the awaitable Work."""
