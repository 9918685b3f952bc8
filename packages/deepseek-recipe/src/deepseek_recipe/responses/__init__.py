"""Protocol chunk generators and response accumulators."""


def response_class(api: str):
    """The response accumulator class of a protocol (`chat_completions`, `messages`, `responses`)."""
    from .chat_completions import ChatCompletionResponse
    from .messages import MessagesResponse
    from .responses import ResponsesResponse

    return {
        "chat_completions": ChatCompletionResponse,
        "messages": MessagesResponse,
        "responses": ResponsesResponse,
    }[api]
