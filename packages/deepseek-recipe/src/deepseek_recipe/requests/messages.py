"""Anthropic Messages request conversion."""

class MessagesRequest:
    def __init__(self, body):
        raise NotImplementedError
