"""The roles a pipeline process can take (`sluice run --role ROLE`), in the order a request meets
them."""

ROLES = ("tokenizer", "scheduler", "runner", "streamer")
