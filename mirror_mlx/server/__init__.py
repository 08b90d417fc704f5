"""`mirror-mlx serve`: an OpenAI-compatible local server with Mirror-SD behind it.

The standard library's ThreadingHTTPServer (as mlx_lm.server) parses HTTP; each connection gets a
thread. One scheduler thread owns the engine, decoding requests alone or batched (scheduler.py).
Beyond --decode-concurrency the others wait in a bounded FIFO, and a request that finds it full gets
429 with Retry-After. The handler looks at its socket and at the shutdown flag between the steps it
receives, so a client that went away, or SIGINT/SIGTERM, frees its slot at the next step boundary, when
the caches are consistent.

Chat requests go through `Pipeline.chat_stream`, which remembers the token ids of the last
conversation: a request that extends it prefills only the new turn (`cached_tokens` in `usage`).
Across conversations, `PrefixCache` keeps the target's caches of recent requests (mlx-lm's
LRUPromptCache). As in mlx_lm.server: tools go to the chat template and tool calls are parsed with the
tokenizer's own tool parser (`ToolText`); `logprobs` are the target's (Step.logprobs); browser pages
from other origins than the allowed ones (`--allowed-origins`, by default this machine's) get 403.
At `/`, a chat page of the package's own files (page.py) draws each reply's steps, which a request asks
for with `x_timeline` (mirror_mlx/timeline.py).
"""

from .http import Server, serve, origin_allowed
from .reply import StopText, ToolText

__all__ = ["Server", "StopText", "ToolText", "origin_allowed", "serve"]
