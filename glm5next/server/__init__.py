"""The OpenAI-compatible HTTP server (`glm5next serve`): a small HTTP/1.1 layer on asyncio
streams (`http`) and the OpenAI protocol over the async engine (`api`)."""

from .api import OpenAIApp, error_response, start_server
from .http import HTTPServer, Request, Response, Router, StreamingResponse

__all__ = ["HTTPServer", "OpenAIApp", "Request", "Response", "Router", "StreamingResponse", "error_response",
           "start_server"]
