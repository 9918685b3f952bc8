"""OpenAI Responses request conversion."""

class ResponsesRequest:
    def __init__(self, body):
        raise NotImplementedError
