"""The OpenAI-compatible HTTP server (`glm5next serve`): request checking independent of any web framework
(`api`, `prompts`, `responses`), the ASGI app on Starlette (`app`, `middleware`, `streaming`, `metrics`),
and uvicorn serving it (`serving`)."""

from .api import ApiError, GenerateRequest
from .app import OpenAIServer
from .serving import Server, start_server
from .settings import ServerSettings

__all__ = ["ApiError", "GenerateRequest", "OpenAIServer", "Server", "ServerSettings", "start_server"]
