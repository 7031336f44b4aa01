"""The guess-the-number judge: a small HTTP service the example's reward calls.

    python -m examples.guess_number.judge --port 8123

POST /score {"secret": 37, "guess": "I say 40", "turns": 3} -> {"correct": 0.0, "closeness": 0.097}
    correct    1.0 when the last number in `guess` is the secret
    closeness  up to 0.1 for a near miss: 0.1 * (1 - |guess - secret| / 100), 0 without a number
GET /health -> 200 once serving; GET /stats -> {"calls": n} (how many /score calls it answered).

`--delay-s` makes every answer wait (a slow judge), `--fail-every N` makes every N-th call
answer 503 (a flaky judge): the generator retries both (generator.reward_retries).
"""

from __future__ import annotations

import argparse
import asyncio
import re

from aiohttp import web

_NUMBER = re.compile(r"-?\d+")


def score(secret: int, guess_text: str) -> dict[str, float]:
    """The judge's verdict on one game (its final guess)."""
    numbers = _NUMBER.findall(guess_text)
    if not numbers:
        return {"correct": 0.0, "closeness": 0.0}
    guess = int(numbers[-1])
    return {
        "correct": float(guess == secret),
        "closeness": round(0.1 * max(0.0, 1.0 - abs(guess - secret) / 100.0), 6),
    }


def make_app(delay_s: float = 0.0, fail_every: int = 0) -> web.Application:
    calls = {"n": 0}

    async def handle_score(request: web.Request) -> web.Response:
        body = await request.json()
        calls["n"] += 1
        print(f"score {calls['n']}: secret {body['secret']}, guess {body['guess']!r}", flush=True)
        if fail_every and calls["n"] % fail_every == 0:
            return web.json_response({"error": "judge overloaded, try again"}, status=503)
        if delay_s:
            await asyncio.sleep(delay_s)
        return web.json_response(score(int(body["secret"]), str(body["guess"])))

    async def handle_health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def handle_stats(request: web.Request) -> web.Response:
        return web.json_response({"calls": calls["n"]})

    app = web.Application()
    app.router.add_post("/score", handle_score)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/stats", handle_stats)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay-s", type=float, default=0.0)
    ap.add_argument("--fail-every", type=int, default=0)
    args = ap.parse_args(argv)
    web.run_app(make_app(args.delay_s, args.fail_every), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
