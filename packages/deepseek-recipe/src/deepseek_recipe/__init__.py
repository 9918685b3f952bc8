"""deepseek-recipe: DeepSeek V4 / V4.1 request conversion, prompt rendering, tokenization and output parsing.

Pure Python (stdlib + HF `tokenizers`); mirrors the public names of DeepSeek's official wheel.
"""

from importlib.metadata import PackageNotFoundError, version

from .encoding.base import RenderedPrompt
from .encoding.special_tokens import IMAGE_SPECIAL_TOKEN_ID, SpecialToken, SpecialTokens
from .encoding.v4 import DeepseekV4Encoding
from .encoding.v41 import DeepseekV41Encoding
from .errors import CalcResizeError, ConversionError, ImageError
from .images import (
    ImageInfo,
    ImageQuota,
    ImageResolver,
    MultiModalData,
    OpenCvImagePreprocessor,
    PreprocessOptions,
    ReqwestImageFetcher,
)
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
from .parsing.stream_processor import InferenceChunk, InferenceFinishReason, PromptUsage, StreamProcessor
from .requests._common import ConversationRequest
from .requests.chat_completions import ChatCompletionRequest
from .requests.messages import MessagesRequest
from .requests.responses import ResponsesEcho, ResponsesRequest
from .responses.chat_completions import (
    ChatCompletionChunk,
    ChatCompletionChunkGenerator,
    ChatCompletionResponse,
)
from .responses.messages import MessagesChunkGenerator, MessagesResponse, MessagesStreamEvent
from .responses.responses import ResponsesChunkGenerator, ResponsesResponse, ResponsesStreamEvent
from .tokenizer import Tokenizer

try:
    __version__ = version("deepseek-recipe")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+source"

# Same public names as the official wheel; the image fetch/preprocess names are stand-ins (see images.py).
__all__ = [
    "IMAGE_SPECIAL_TOKEN_ID",
    "AssistantMessage",
    "BytesImageSource",
    "CalcResizeError",
    "ChatCompletionChunk",
    "ChatCompletionChunkGenerator",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "Conversation",
    "ConversationRequest",
    "ConversionError",
    "ConversionOptions",
    "DataUrlImageSource",
    "DeepseekV41Encoding",
    "DeepseekV4Encoding",
    "ImageError",
    "ImageInfo",
    "ImageQuota",
    "ImageResolver",
    "ImageSource",
    "InferenceChunk",
    "InferenceFinishReason",
    "InferenceOptions",
    "LatestReminderMessage",
    "Message",
    "MessagesChunkGenerator",
    "MessagesRequest",
    "MessagesResponse",
    "MessagesStreamEvent",
    "ModelVersion",
    "MultiModalData",
    "OpenCvImagePreprocessor",
    "OutputConstraint",
    "ParsingOptions",
    "PreprocessOptions",
    "PromptUsage",
    "ReasoningContentBehavior",
    "RenderedPrompt",
    "ReqwestImageFetcher",
    "ResponsesChunkGenerator",
    "ResponsesEcho",
    "ResponsesRequest",
    "ResponsesResponse",
    "ResponsesStreamEvent",
    "SpecialToken",
    "SpecialTokens",
    "StreamProcessor",
    "SystemMessage",
    "ThinkingInitialStage",
    "Tokenizer",
    "ToolCall",
    "ToolDefinition",
    "ToolMessage",
    "UrlImageSource",
    "UserMessage",
    "WebSearchBehavior",
    "__version__",
]
