"""`OpenAIServer`: an OpenAI-compatible HTTP endpoint on a sampler, generating with its backend.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``, at the root
and under a session's path ``/s/<key>/v1/...`` (the ``base_url`` an episode's agent is given).
A request under a session path is recorded in that `Session` (``session.py``); one at the root is
served and recorded nowhere. ``stream: true`` is answered as server-sent events (``sse.py``): the
text as the backend generates it (after each decoding step on HF, with each engine output on vLLM),
in pieces no later token can change (``stream.py``), then the rest of the answer, ``[DONE]``.
A client that goes away (its episode ended, its agent gave up waiting) stops its request: its
generation is cancelled (a gathered one goes on for the others in it) and its call is not recorded,
since the agent never saw it; nothing above debug is logged, as for a server that shuts down.

Safety: it binds 127.0.0.1 unless told otherwise; every request must carry ``Authorization:
Bearer <token>``, the token the server was made with (401 otherwise); bodies are JSON decoded
into typed structs (msgspec) and never evaluated; a body over ``max_body_bytes`` is refused.
It serves only the sampler's policy: the ``model`` a request names is not looked up (any name
gets the policy), and ``/v1/models`` lists it as `MODEL_NAME`.

Sampling in a session is the run's: ``temperature`` and ``top_p`` are the sampler's whatever the
request says, since the trainer scores the tokens at the run's temperature and its importance
ratio needs their log-probs under that very distribution; ``max_tokens`` (capped by the run's
``max_new_tokens`` and the model's context), ``stop``, ``seed``, ``n`` (each completion a call of the
session, recorded as a sample of its own) and ``top_logprobs`` are the request's.
At the root the request's temperature and top_p are used.

Why aiohttp: one maintained package that serves HTTP on the actor's own event loop (no second
loop or thread to hand requests across, as uvicorn would want) and starts and stops as an
``AppRunner`` we own; FastAPI would add starlette, pydantic and uvicorn for a handful of routes.
It ships in the ``agents`` extra (``pip install 'asyncrl[agents]'``), with ``openai`` for agents.

Requests reach the sampler's ``generate`` through a `RequestBatcher` (``batcher.py``); the request
bodies and the answer are ``wire.py``'s; a request refused is answered with ``refusal.py``'s error body.
"""

from __future__ import annotations

import functools
import hmac
import secrets
from typing import Any

import msgspec

from asyncrl.errors import AsyncrlError
from asyncrl.rl.agents.batcher import EndpointClosedError, Generate, Progress, RequestBatcher
from asyncrl.rl.agents.chat import ChatRequestError, compact_calls, render_chat
from asyncrl.rl.agents.refusal import Refused, decode_body, error_response, json_response
from asyncrl.rl.agents.session import Session, SessionCall
from asyncrl.rl.agents.sse import stream_answer
from asyncrl.rl.agents.wire import MODEL_NAME, ChatRequest, CompletionRequest, chat_answer, text_answer
from asyncrl.rl.generation import Completion, SamplingParams
from asyncrl.runtime.timeouts import timeout

BACKLOG = 4096
"""Connections the kernel queues before the loop accepts them: every episode of a round connects
at once, and the loop may be busy meanwhile (aiohttp's 128 left 43 of 800 evaluation episodes
with a connection error). Linux caps it at ``net.core.somaxconn`` (4096 since 5.4)."""
MAX_CHOICES = 16
"""The most completions (``n``) one request may ask; in a session each counts as a model call."""
SHUTDOWN_S = 5.0
"""How long `OpenAIServer.close` lets requests still being answered finish (aiohttp's default: 60 s)."""


class EndpointError(AsyncrlError):
    """The endpoint cannot start (aiohttp missing, the address taken); the message says how to fix it."""


class OpenAIServer:
    """The endpoint of one sampler. ``generate``: the sampler's generation (which tags the weight
    version); ``tokenizer``: the policy's (its chat template renders chat requests);
    ``sampling``: the run's sampling (temperature, top_p, max_new_tokens, stop token ids);
    ``max_context``: the model's positions (0: unknown); ``batch``: gather concurrent requests into
    one ``generate`` call (a backend that runs one batch at a time); ``request_timeout_s``: the
    most a request waits for its generation (504 past it); ``max_calls``: model calls a session
    may make (an agent that loops for ever is refused past them)."""

    def __init__(
        self,
        generate: Generate,
        tokenizer: Any,
        sampling: SamplingParams,
        *,
        max_context: int = 0,
        batch: bool = True,
        token: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
        request_timeout_s: float = 600.0,
        max_calls: int = 32,
        max_body_bytes: int = 8 << 20,
    ):
        self.tokenizer, self.sampling, self.max_context = tokenizer, sampling, max_context
        self.compact_calls = compact_calls(tokenizer)  # the embedded model's call form, not Hermes's JSON
        self.token = token or secrets.token_urlsafe(24)
        self.host, self.port = host, port
        self.request_timeout_s, self.max_calls, self.max_body_bytes = request_timeout_s, max_calls, max_body_bytes
        self.sessions: dict[str, Session] = {}
        self._batcher = RequestBatcher(generate, batch)
        self._runner = None

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and serve; returns the root ``base_url`` (``http://HOST:PORT/v1``)."""
        try:
            from aiohttp import web
        except ImportError:
            raise EndpointError("the OpenAI endpoint needs aiohttp: pip install 'asyncrl[agents]'") from None
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._auth()])
        for prefix in ("", "/s/{session}"):
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=SHUTDOWN_S,
            handler_cancellation=True,  # a client that goes away stops its request (module docstring)
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=False, backlog=BACKLOG)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise EndpointError(f"the OpenAI endpoint cannot listen on {self.host}:{self.port}: {exc}") from None
        self._runner = runner
        self.port = runner.addresses[0][1]  # port 0: the one the OS picked
        return self.base_url()

    async def close(self) -> None:
        """Stop serving: requests waiting for generation are answered 503 at once, then the
        listener closes (its handlers given `SHUTDOWN_S` to finish). Idempotent."""
        self._batcher.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def base_url(self, session: str = "") -> str:
        """The ``base_url`` to give an OpenAI client: the root, or a session's."""
        return f"http://{self.host}:{self.port}" + (f"/s/{session}" if session else "") + "/v1"

    def client(self, session: str = "") -> Any:
        """An ``openai.AsyncOpenAI`` for a session (or the root), with this endpoint's token and no
        retries (a failed call is the agent's to handle). Its own HTTP client, made without loading
        the system's CA certificates (``verify=False``): the endpoint is plain HTTP on a local
        address, so there is nothing to verify, and loading them costs time at every client
        (benchmarks/README.md, "Figures that were in the code")."""
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url(session),
            api_key=self.token,
            max_retries=0,
            timeout=self.request_timeout_s + 10,
            http_client=openai.DefaultAsyncHttpxClient(verify=False),
        )

    # --- sessions ---------------------------------------------------------------------------------

    def open_session(self) -> Session:
        """A new session with a key no one can guess; its calls are recorded until `close_session`."""
        session = Session(secrets.token_urlsafe(16), self.max_calls)
        self.sessions[session.key] = session
        return session

    def close_session(self, key: str) -> Session:
        """Stop recording ``key`` (later requests under it get 404) and forget it; its calls stay."""
        session = self.sessions.pop(key)
        session.closed = True
        return session

    # --- HTTP -------------------------------------------------------------------------------------

    def _auth(self):
        from aiohttp import web

        @web.middleware
        async def check(request, handler):
            given = request.headers.get("Authorization", "")
            expected = f"Bearer {self.token}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return error_response(
                    401, "missing or wrong API key: send the run's token as the bearer token", "authentication_error"
                )
            try:
                return await handler(request)
            except Refused as exc:
                return error_response(exc.status, str(exc), exc.kind, exc.code)

        return check

    async def _models(self, request):
        self._session(request)
        return json_response(
            {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "asyncrl"}]}
        )

    async def _chat(self, request):
        session = self._session(request)
        body = await decode_body(request, ChatRequest)
        try:
            prompt = render_chat(self.tokenizer, body.messages, body.tools)
        except ChatRequestError as exc:
            raise Refused(400, str(exc)) from None
        if body.top_logprobs and not body.logprobs:
            raise Refused(400, "top_logprobs needs logprobs: true")
        top = (body.top_logprobs or 0) if body.logprobs else 0
        max_tokens = body.max_completion_tokens or body.max_tokens

        def answer(completions: list[Completion]) -> dict:
            return chat_answer(
                completions,
                len(prompt),
                tools=bool(body.tools),
                compact=self.compact_calls,
                model=body.model,
                piece=self._piece if body.logprobs else None,
            )

        if body.stream:
            generate = functools.partial(self._generate, session, prompt, body, max_tokens, top)
            return await stream_answer(
                request, body, self.tokenizer, self.sampling.stop_token_ids, generate, answer, chat=True
            )
        return json_response(answer(await self._generate(session, prompt, body, max_tokens, top)))

    async def _completions(self, request):
        session = self._session(request)
        body = await decode_body(request, CompletionRequest)
        if isinstance(body.prompt, str):
            prompt = list(self.tokenizer(body.prompt, add_special_tokens=False)["input_ids"])
        else:
            prompt = list(body.prompt)

        def answer(completions: list[Completion]) -> dict:
            return text_answer(
                completions, len(prompt), model=body.model, piece=self._piece if body.logprobs is not None else None
            )

        if body.stream:
            generate = functools.partial(self._generate, session, prompt, body, body.max_tokens, body.logprobs or 0)
            return await stream_answer(
                request, body, self.tokenizer, self.sampling.stop_token_ids, generate, answer, chat=False
            )
        return json_response(answer(await self._generate(session, prompt, body, body.max_tokens, body.logprobs or 0)))

    # --- generation -------------------------------------------------------------------------------

    def _session(self, request) -> Session | None:
        key = request.match_info.get("session")
        if key is None:
            return None
        session = self.sessions.get(key)
        if session is None:
            raise Refused(404, "no such session, or its episode has ended", "not_found_error")
        return session

    def _params(
        self, session: Session | None, body: Any, max_tokens: int | None, prompt_len: int, top_logprobs: int
    ) -> SamplingParams:
        if not 1 <= body.n <= MAX_CHOICES:
            raise Refused(400, f"n must be in [1, {MAX_CHOICES}], not {body.n}")
        room = self.sampling.max_new_tokens
        if max_tokens is not None:
            if max_tokens < 1:
                raise Refused(400, f"max_tokens must be >= 1, not {max_tokens}")
            room = min(room, max_tokens)
        if self.max_context:
            if prompt_len >= self.max_context:
                raise Refused(
                    400,
                    f"the prompt has {prompt_len} tokens, and the model reads at most "
                    f"{self.max_context}: shorten the conversation",
                    code="context_length_exceeded",  # OpenAI's: what an agent tests (openai's exc.code)
                )
            room = min(room, self.max_context - prompt_len)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        temperature, top_p = self.sampling.temperature, self.sampling.top_p
        if session is None:  # the root: not trained on, so the caller's sampling
            temperature = body.temperature if body.temperature is not None else temperature
            top_p = body.top_p if body.top_p is not None else top_p
        try:
            return msgspec.structs.replace(
                self.sampling,
                max_new_tokens=room,
                temperature=temperature,
                top_p=top_p,
                stop=[s for s in stop if s],
                seed=body.seed,
                top_logprobs=top_logprobs,
            )
        except ValueError as exc:
            raise Refused(400, str(exc)) from None

    async def _generate(
        self,
        session: Session | None,
        prompt: list[int],
        body: Any,
        max_tokens: int | None,
        top_logprobs: int = 0,
        progress: Progress | None = None,
    ) -> list[Completion]:
        """``body.n`` completions of ``prompt``, each recorded in ``session`` as a call of its own
        (so each is a sample of its own: none extends another); ``progress(choice, ids)`` is told
        their tokens as they come."""
        if not prompt:
            raise Refused(400, "the prompt is empty")
        vocab = len(self.tokenizer)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise Refused(400, f"prompt token ids must be in [0, {vocab})")
        params = self._params(session, body, max_tokens, len(prompt), top_logprobs)
        n = body.n
        if session is not None:
            if len(session.calls) + session.in_flight + n > session.max_calls:
                raise Refused(
                    429,
                    f"this session may make {session.max_calls} model calls (n counts each), and "
                    f"{len(session.calls) + session.in_flight} are made or under way",
                    "rate_limit_error",
                )
            session.in_flight += n
        try:
            async with timeout(self.request_timeout_s):
                version, completions = await self._batcher.submit(prompt, params, n, progress)
        except TimeoutError:
            raise Refused(
                504, f"the sampler generated nothing for this request within {self.request_timeout_s:g} s", "timeout"
            ) from None
        except EndpointClosedError as exc:
            raise Refused(503, str(exc), "server_error") from None
        except Exception as exc:  # the backend closed or failed: the agent sees it as a server error
            raise Refused(
                503, f"the sampler cannot generate now: {type(exc).__name__}: {exc}", "server_error"
            ) from None
        finally:
            if session is not None:
                session.in_flight -= n
        if session is not None:
            for completion in completions:
                session.record(
                    SessionCall(
                        prompt, list(completion.token_ids), list(completion.logprobs), version, completion.finish_reason
                    )
                )
        return completions

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
