"""The ``specbatch`` command: up, generate, demo, bench, profile, bench-engine, distill."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from google.protobuf.json_format import MessageToDict

from specbatch.config.options import DEFAULT_PORTS, UP, add_options

DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORTS['coordinator']}"


def cmd_up(args) -> int:
    from specbatch.rpc.server import PortUnavailable
    from specbatch.stack.defaults import stack_options
    from specbatch.stack.processes import LocalProcesses

    processes = LocalProcesses(stack_options(args))
    try:
        processes.check_ports()
    except PortUnavailable as error:
        raise SystemExit(str(error)) from None
    stop = threading.Event()
    serving = False

    # Our own handlers: a shell that starts us in the background leaves SIGINT ignored. The
    # services run in process groups of their own (prefork.popen), so a Ctrl-C reaches only us.
    def on_signal(*_) -> None:
        if not serving:
            raise KeyboardInterrupt  # nothing served yet: stop starting now
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print("starting target, draft and coordinator (the first start converts the embedded model) …", flush=True)
    try:
        processes.start()
        serving = True
        options = processes.options
        policy = options.k_policy + (f" over the profile {options.profile}" if options.profile else "")
        in_force = processes.k_policy_in_force() if options.coordinator else options.k_policy
        if in_force and in_force != options.k_policy:  # the coordinator found the profile another deployment's
            policy = f"{in_force}: the profile {options.profile} describes another deployment"
        print(f"serving on {processes.address} (k policy {policy}); Ctrl-C stops everything", flush=True)
        while not stop.wait(1.0):
            processes.check_alive()
    except KeyboardInterrupt:
        return 1
    finally:
        # A second Ctrl-C must not cut the clean stop short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # The coordinator first: the streams in flight finish within its --drain-seconds (they
        # need the services), then the services stop.
        print("stopping: finishing the requests in flight …" if serving else "stopping …", flush=True)
        processes.stop()
    return 0


def add_sampling_flags(parser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--k", type=int, help="fixed speculation length for this request")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def cmd_generate(args) -> int:
    import grpc

    from specbatch.rpc.client import connect, generate, make_request

    if args.token_ids:
        prompt = [int(t) for t in args.token_ids.split(",") if t.strip()]
    else:
        prompt = args.prompt
        if prompt is None:
            print("give a prompt, or --token-ids", file=sys.stderr)
            return 2
    request = make_request(prompt, args.max_new_tokens, chat=args.chat, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed, k=args.k, stop=args.stop,
                           ignore_eos=args.ignore_eos)

    def show(response):
        if args.json:
            print(json.dumps(MessageToDict(response, preserving_proto_field_name=True)), flush=True)
        else:
            print(response.text, end="", flush=True)

    credentials = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        from specbatch.rpc.tls import channel_credentials

        try:
            credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        except (OSError, ValueError) as error:
            print(f"TLS: {error}", file=sys.stderr)
            return 2
    try:
        result = generate(connect(args.address, credentials), request, on_response=show)
    except grpc.RpcError as error:
        print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    if not args.json:
        s = result.stats
        print(f"\n[{result.finish}] {s.generated_tokens} tokens in {result.seconds:.2f}s "
              f"({result.tokens_per_second:.1f} tok/s), acceptance {result.acceptance:.2f} "
              f"({s.draft_tokens_accepted}/{s.draft_tokens_proposed} drafts, {s.steps} steps)", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from specbatch.commands.demo import run_demo

    return run_demo(args)


def cmd_bench(args) -> int:
    from specbatch.commands.bench.run import run_bench

    return run_bench(args)


def cmd_profile(args) -> int:
    from specbatch.commands.profiler import run_profile

    return run_profile(args)


def cmd_bench_engine(args) -> int:
    from specbatch.commands.bench.engine import run_bench_engine

    return run_bench_engine(args)


def cmd_distill(args) -> int:
    from specbatch.commands.distill.run import run_distill

    return run_distill(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run target, draft and coordinator locally in the foreground")
    add_options(up, UP)
    up.set_defaults(fn=cmd_up)

    gen = sub.add_parser("generate", help="stream one generation from a running coordinator")
    gen.add_argument("prompt", nargs="?", help="prompt text")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--token-ids", help="comma-separated prompt token ids instead of text")
    gen.add_argument("--json", action="store_true", help="one JSON object per response, with token ids")
    gen.add_argument("--address", default=DEFAULT_ADDRESS)
    gen.add_argument("--tls-ca", metavar="PEM", help="connect over TLS, trusting this CA (PEM) for the coordinator")
    gen.add_argument("--tls-cert", metavar="PEM", help="client certificate, where the coordinator requires one (mTLS)")
    gen.add_argument("--tls-key", metavar="PEM", help="the client certificate's private key")
    add_sampling_flags(gen)
    gen.set_defaults(fn=cmd_generate)

    demo = sub.add_parser("demo", help="start everything, stream a few chat answers, report, stop")
    add_options(demo, UP)
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(fn=cmd_demo)

    from specbatch.commands.bench.run import add_bench_flags

    bench = sub.add_parser("bench", help="k=0, fixed k and the k policies under uniform, trace and Poisson traffic")
    add_options(bench, UP)
    add_bench_flags(bench)
    bench.set_defaults(fn=cmd_bench)

    from specbatch.commands.profiler import add_profile_flags

    profile = sub.add_parser("profile", help="measure step time and acceptance over batch size x k; write the profile")
    add_options(profile, UP)
    add_profile_flags(profile)
    profile.set_defaults(fn=cmd_profile)

    from specbatch.commands.bench.engine import add_bench_engine_flags

    bench_engine = sub.add_parser("bench-engine", help="ms per verify step and per drafted token over batch x tokens, "
                                  "beside the bandwidth limit")
    add_bench_engine_flags(bench_engine)
    bench_engine.set_defaults(fn=cmd_bench_engine)

    from specbatch.commands.distill.run import add_distill_flags

    distill = sub.add_parser("distill", help="train an EAGLE-style draft for a target (resumable)")
    add_distill_flags(distill)
    distill.set_defaults(fn=cmd_distill)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
