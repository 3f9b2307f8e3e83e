"""The reasoning harness: model turns, tool calls over Kafka and their results as a durable loop
(`run.py`: one run as a state machine; `service.py`: the process that drives runs over Kafka)."""
