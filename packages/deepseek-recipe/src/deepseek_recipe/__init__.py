"""deepseek-recipe: DeepSeek V4 / V4.1 request conversion, prompt rendering, tokenization and output parsing.

Pure Python (stdlib + HF `tokenizers`); mirrors the public names of DeepSeek's official wheel.
"""

from importlib.metadata import PackageNotFoundError, version

from .encoding.base import RenderedPrompt
from .encoding.special_tokens import IMAGE_SPECIAL_TOKEN_ID, SpecialToken, SpecialTokens
from .encoding.v4 import DeepseekV4Encoding
from .encoding.v41 import DeepseekV41Encoding
from .errors import CalcResizeError, ConversionError, ImageError
from .messages import (
    AssistantMessage,
    BytesImageSource,
    Conversation,
    DataUrlImageSource,
    ImageSource,
    LatestReminderMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UrlImageSource,
    UserMessage,
)
from .tokenizer import Tokenizer
from .options import (
    ConversionOptions,
    InferenceOptions,
    ModelVersion,
    OutputConstraint,
    ParsingOptions,
    ReasoningContentBehavior,
    ThinkingInitialStage,
    WebSearchBehavior,
)
from .requests._common import ConversationRequest
from .requests.chat_completions import ChatCompletionRequest
from .requests.messages import MessagesRequest
from .requests.responses import ResponsesRequest

try:
    __version__ = version("deepseek-recipe")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

__all__ = [
    "IMAGE_SPECIAL_TOKEN_ID",
    "AssistantMessage",
    "BytesImageSource",
    "CalcResizeError",
    "Conversation",
    "ConversionError",
    "DataUrlImageSource",
    "DeepseekV41Encoding",
    "DeepseekV4Encoding",
    "ImageError",
    "ImageSource",
    "LatestReminderMessage",
    "Message",
    "RenderedPrompt",
    "SpecialToken",
    "SpecialTokens",
    "SystemMessage",
    "Tokenizer",
    "ToolCall",
    "ToolDefinition",
    "ToolMessage",
    "UrlImageSource",
    "UserMessage",
    "__version__",
]
