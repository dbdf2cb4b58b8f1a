"""The library entry point: ``Engine.load(dir).generate(prompt, ...)``: an engine directory's graphs on their
backends, the drafter choice (:class:`~dspark_runtime.drafting.factory.DrafterFactory`) and the decoding loops over
them (:class:`~dspark_runtime.decoding.loop.DecodingLoop`)."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

from dspark_runtime.backends.ort import OrtDecoder, enable_shared_thread_pool
from dspark_runtime.backends.ort_cuda import OrtDeviceDecoder
from dspark_runtime.backends.placement import (PROVIDERS, engine_placement, format_placement,
                                              trt_engines_run)
from dspark_runtime.backends.prompt_place import PromptChunkBackend, resolve_prompt_place
from dspark_runtime.backends.trt.decoder import TrtDecoder
from dspark_runtime.backends.trt.dspark_graph import TrtDSparkGraph
from dspark_runtime.decoding.loop import DecodingLoop
from dspark_runtime.decoding.prefix_cache import PrefixCache
from dspark_runtime.decoding.grammar import GrammarCompiler
from dspark_runtime.decoding.request import GenerationResult, TextStream, check_request, cut_at_stop
from dspark_runtime.drafting.dspark import DSparkHeads, OrtDSparkGraph
from dspark_runtime.drafting.embedding_rows import EmbeddingRows
from dspark_runtime.drafting.eagle3 import OrtEagle3Graph, eagle3_vocab
from dspark_runtime.drafting.factory import DrafterFactory
from dspark_runtime.engine_dir.artifact import is_tarball, unpacked_dir
from dspark_runtime.engine_dir.graphspec import attention_rows_per_query
from dspark_runtime.engine_dir.manifest import PROMPT_GRAPH, Manifest, load_manifest
from dspark_runtime.engine_dir.tokenizer import Tokenizer
from dspark_runtime.errors import InputError
from dspark_runtime.machine.cost_profile import profile_runtime
from dspark_runtime.machine.load_checks import (check_cpu, check_int8_weights, check_kernels, head_skips_padding,
                                               target_sha256)
from dspark_runtime.machine.load_checks import row_multiple as load_row_multiple
from dspark_runtime.machine.row_invariance import probe_target_rows
from dspark_runtime.machine.sysinfo import DEFAULT_THREADS
from dspark_runtime.runners.factory import batch_runner, decoder_runner
from dspark_runtime.runners.sequence import DecoderRunner, SequenceRunner

# the prompt graph's session leaves its weights on base pages: its prompt chunks are compute-bound (huge pages buy
# 0-5% a chunk) and collapsing its 1.4 GB of prepacked 8-bit weights would cost seconds at its first use
# (docs/precision.md, "The prompt graph by default")
PROMPT_GRAPH_OPTIONS = {PROMPT_GRAPH: {"huge_pages": False}}
# the backend that runs each drafter graph kind on the CPU (a decoder graph: OrtDecoder)
GRAPH_BACKENDS = {"dspark_draft": OrtDSparkGraph, "eagle3_draft": OrtEagle3Graph}


class Engine:
    """A loaded engine directory: tokenizer, target (verifier) graph and optional draft graphs.

    Construct with :meth:`load`. Sessions are created on first use (``activate``), so loading
    is cheap until the first generation. ``drafters``: its :class:`~dspark_runtime.drafting.factory.DrafterFactory`.
    """

    def __init__(self, engine_dir: Path, manifest: Manifest, threads: int = DEFAULT_THREADS, providers=None,
                 backend: str = "ort", allow_slow_precision: bool = False, row_multiple: int | None = None,
                 placement: str | dict | None = None, prompts: str = "auto"):
        self.dir = Path(engine_dir)
        self.manifest = manifest
        tok = manifest.tokenizer
        self.tokenizer = Tokenizer(self.dir / tok["dir"])
        self.eos_ids = list(tok.get("eos_token_ids", []))
        self._grammars = None  # the GrammarCompiler, built on the first constrained request
        self.placement = engine_placement(self.dir, manifest, placement, backend, providers)
        self._backends = {
            key: GRAPH_BACKENDS.get(g.spec.kind, OrtDecoder)(
                self.dir / g.model_file, g.spec, threads=threads,
                providers=providers or PROVIDERS.get(self.placement[key], PROVIDERS["cpu"]), precision=g.precision,
                allow_slow_precision=allow_slow_precision, **PROMPT_GRAPH_OPTIONS.get(key, {}))
            for key, g in manifest.graphs.items()
        }
        # graphs run by a capacity-layout decoder on a GPU (TensorRT, or ONNX Runtime's CUDA provider on a device
        # graph): {key: its manifest entry}; the decoding loop drives them through a DeviceBatchRunner
        self._device_entries: dict = {}
        self._use_tensorrt()
        self._use_device_graphs(threads)
        # the target's backend ("ort", or "trt" / "cuda" on a capacity-layout decoder): row padding, CPU checks
        self.backend = self.placement["target"] if "target" in self._device_entries else "ort"
        ds = manifest.speculation.dspark
        if ds is not None and ds.embedding is not None and ds.graph in self._backends:
            self._backends[ds.graph].embedding = EmbeddingRows.from_manifest(self.dir, ds.embedding)
        e3 = manifest.speculation.eagle3
        if e3 is not None and e3.graph in self._backends:
            self._backends[e3.graph].embedding = EmbeddingRows.from_manifest(self.dir, e3.embedding)
            self._backends[e3.graph].draft_vocab = eagle3_vocab(self.dir, e3, manifest.graphs[e3.graph].spec,
                                                                manifest.graphs["target"].spec.dims.vocab_size)
        self._runners: dict = {}
        self._solo_runners: dict = {}  # graph key -> the decoding loop's runner for one request (loop_runner)
        self.row_multiple = load_row_multiple(manifest, self.dir, self.backend, row_multiple, threads)
        # the target's LM head on a padded call's real rows only, where the stored probe found that exact
        self.head_skips_padding = head_skips_padding(manifest, self.backend, row_multiple)
        # where prompt chunks run: "target", "prompt-graph" (graph target_prompt) or "openvino" (the target graph on
        # ONNX Runtime's OpenVINO provider, checked chunking-invariant on first use)
        self.prompts = resolve_prompt_place(prompts, manifest, self.placement)
        self._prompt_chunks = PromptChunkBackend(self.prompts, self.dir, manifest, self._backends, threads)
        check_cpu(manifest, self.dir, self.backend, probe_used=row_multiple is None)
        check_int8_weights(manifest, self.dir, self.backend)
        check_kernels(manifest, self.dir)
        self.default_draft_length = manifest.speculation.draft_length or 5
        self._warned_packed = False  # batch() warns once that a batch-dependent runner is in use
        # a draft LM (causal_lm graph) and/or a DSpark drafter (dspark_draft graph) may be present
        self.drafters = d = DrafterFactory(self.dir, manifest, self._backends, self.loop_runner)
        self.lm_graph, self.dspark_graph, self.draft_graph, self.draft_kind = (d.lm_graph, d.dspark_graph,
                                                                               d.draft_graph, d.draft_kind)
        self.prefix_cache = None  # a PrefixCache shared by this engine's decoding loops (enable_prefix_cache)
        self.last_batch_stats = None  # aggregate BatchStats of the last generate_batch

    def _use_tensorrt(self) -> None:
        """Run the graphs placed on ``trt`` on their TensorRT engines (:func:`~dspark_runtime.backends.placement.
        trt_engines_run`): decoders on a :class:`~dspark_runtime.backends.trt.decoder.TrtDecoder`, the DSpark drafter
        on a :class:`~dspark_runtime.backends.trt.dspark_graph.TrtDSparkGraph` (constructed only; nothing touches the
        GPU here)."""
        trt = [k for k, p in self.placement.items() if p == "trt"]
        if not trt:
            return
        engines = trt_engines_run(self.manifest)
        for key in trt:
            e = engines[key]
            if e.spec.kind == "dspark_draft":  # rows for every request of a batch (its buffers are small)
                self._backends[key] = TrtDSparkGraph(self.dir, e, batch=int(e.profile_settings["max_batch"]))
            else:  # one row until a decoding loop sets its rows (DeviceBatchRunner)
                self._backends[key] = TrtDecoder(self.dir, e)
                self._device_entries[key] = e

    def _use_device_graphs(self, threads: int) -> None:
        """Run the decoder graphs placed on ``cuda`` that have a device graph (``dspark-export build-cuda``) on an
        :class:`~dspark_runtime.backends.ort_cuda.OrtDeviceDecoder` (K/V resident on the GPU, CUDA graphs); graphs
        without one keep ONNX Runtime's CUDA provider on host buffers (constructed only: nothing touches the GPU
        here)."""
        cuda = [k for k, p in self.placement.items() if p == "cuda" and k in self.manifest.device_graphs]
        if not cuda:
            return
        for key in cuda:
            e = self.manifest.device_graphs[key]
            self._backends[key] = OrtDeviceDecoder(self.dir, e, threads=threads)
            self._device_entries[key] = e

    @classmethod
    def load(cls, engine_dir: str | Path, threads: int = DEFAULT_THREADS, providers=None,
             verify: bool = True, rehash: bool = False, backend: str = "ort",
             allow_slow_precision: bool = False, row_multiple: int | None = None,
             shared_thread_pool: bool = False, placement: str | dict | None = None,
             prefix_cache_mb: float = 0, prompts: str = "auto") -> "Engine":
        """Load ``engine_dir`` through its manifest. A ``*.tar.gz`` from ``dspark-export pack`` is unpacked
        (once, into ``$DSPARK_CACHE/engines``; every file checked against the manifest's sha256) and loaded.

        Raises ManifestError for a missing directory or manifest, an unsupported schema version,
        or a missing/corrupted file (sha256; trusted by size+mtime after one full hash unless
        ``rehash``). ``backend``: "ort" (ONNX Runtime) or "trt" (the manifest's capacity-layout TensorRT
        engines for the target / draft LM; batches of up to the engines' ``--max-batch`` requests).
        ``allow_slow_precision``: let fp8/fp16 graphs (built for GPUs) run on the CPU provider; without it
        their first use raises DSparkError saying why. ``row_multiple``: pad every target call to a multiple
        of this many rows so target-only and speculative decoding compute every position bit for bit alike
        (:mod:`dspark_runtime.machine.row_invariance`); default: the value ``dspark-export profile`` probed and stored in
        the manifest, else 1 (no padding). Warns (:class:`~dspark_runtime.machine.sysinfo.OtherCpuWarning`) when that
        probe or the stored cost table was measured on another CPU (model or ISA flags; re-run
        ``dspark-export profile`` here). ``shared_thread_pool``: run every session on one process-wide ONNX
        Runtime thread pool whose threads spin (process-wide and irreversible:
        :func:`dspark_runtime.backends.ort.enable_shared_thread_pool`; the CLI, the server and the benchmarks turn it
        on). ``placement``: where each graph runs,
        ``"target=trt,draft=cuda,dspark=cpu"`` or one place for all (:mod:`dspark_runtime.backends.placement`: cpu, cuda,
        trt-ep, trt; default every graph on the CPU; ``backend="trt"`` is ``placement="trt"``); raises InputError
        for a placement it refuses (an unknown graph or place, ``trt`` without a TensorRT engine).
        ``prefix_cache_mb``: the prefix KV cache's memory bound in MiB, 0 = off (:meth:`enable_prefix_cache`).
        ``prompts``: where prompt chunks run, in every decoding mode alike (:mod:`dspark_runtime.backends.prompt_place`):
        "target", "prompt-graph" (``dspark-export add-prompt-graph``), "openvino" (the target on ONNX Runtime's
        OpenVINO provider, Intel CPUs, ``pip install 'dspark[openvino]'``), "auto" (the prompt graph where the engine
        has one that this CPU computes right, else the target); raises InputError for a choice this engine cannot run.
        """
        if not isinstance(threads, int) or threads < 1:
            raise InputError(f"threads must be a positive integer, got {threads!r}")
        if shared_thread_pool and backend == "ort" and placement in (None, "", "cpu"):
            size = enable_shared_thread_pool(threads)
            if size != threads:
                warnings.warn(f"this process's shared ONNX Runtime thread pool has {size} threads; {engine_dir} "
                              f"runs on it, not on {threads}", stacklevel=2)
        if is_tarball(engine_dir):
            engine_dir = unpacked_dir(engine_dir)
        eng = cls(Path(engine_dir), load_manifest(engine_dir, verify=verify, rehash=rehash), threads, providers,
                  backend, allow_slow_precision, row_multiple, placement, prompts)
        eng.enable_prefix_cache(prefix_cache_mb)
        return eng

    def enable_prefix_cache(self, max_mb: float) -> None:
        """Reuse cached prompt positions across requests (:mod:`dspark_runtime.decoding.prefix_cache`): every decoding loop
        of this engine (:meth:`batch`, :meth:`generate`, the server's) starts a joining request from the cached
        blocks of its prompt's longest cached prefix — the target's keys, values and features (the DSpark drafter's
        context comes from those features) and the draft LM's keys and values — and stores what a finished request
        cached, least recently used blocks evicted beyond ``max_mb`` MiB. 0 turns it off and drops what it held.
        Raises InputError for a negative bound, or (when turning it on) a target graph outside the scatter KV layout
        or placed on TensorRT."""
        if isinstance(max_mb, bool) or not isinstance(max_mb, (int, float)) or max_mb < 0:
            raise InputError(f"prefix_cache_mb must be a number of MiB >= 0 (0 = off), got {max_mb!r}")
        self.prefix_cache = None
        if not max_mb:
            return
        if self.manifest.graphs["target"].spec.kv_layout != "scatter" or "target" in self._device_entries:
            raise InputError(f"{self.dir}: the prefix cache reuses cached positions of the scatter KV layout, and this "
                             "engine's target graph is not in it (or runs on TensorRT); rebuild it with `dspark-export "
                             "build --kv-layout scatter` (the int4 default) or leave the prefix cache off")
        self.prefix_cache = PrefixCache(max(1, int(max_mb * 2 ** 20)))

    # -- the drafter choice (DrafterFactory)

    @property
    def has_draft(self) -> bool:
        return self.drafters.has_draft

    def auto_draft(self) -> str:
        """What ``draft="auto"`` means for this engine (:meth:`DrafterFactory.auto_draft`)."""
        return self.drafters.auto_draft()

    def resolve_draft(self, draft) -> str | None:
        """The drafter kind a ``draft`` choice names (:meth:`DrafterFactory.resolve`); InputError as it."""
        return self.drafters.resolve(draft)

    def graphs_used(self, draft) -> list:
        """The graph keys a ``draft`` choice runs (:meth:`DrafterFactory.graphs_used`)."""
        return self.drafters.graphs_used(draft)

    def drafter(self, draft, target, confidence_threshold=None, confidence_rule: str = "survival",
                max_batch: int = 8):
        """The drafter for a ``draft`` choice over the verifier runner ``target``, with this engine's prefix cache
        (:meth:`DrafterFactory.drafter`); None for target-only."""
        return self.drafters.drafter(draft, target, confidence_threshold, confidence_rule, max_batch,
                                     prefix_cache=self.prefix_cache)

    def dspark_heads(self) -> DSparkHeads:
        """The DSpark Markov/confidence heads, loaded once (:meth:`DrafterFactory.dspark_heads`)."""
        return self.drafters.dspark_heads()

    # -- runners

    def runner(self, key: str) -> DecoderRunner:
        """The one-sequence runner of graph ``key`` ("target" or "draft"; a DecoderRunner, or its scatter-layout twin
        ScatterSequence), activating its session. On TensorRT it shares the graph's decoder with the decoding loops'
        runners: using it ends a batched loop's use of that decoder (one runner at a time)."""
        backend = self._backends[key].activate()
        if key in self._device_entries and backend.batch != 1:  # a batched loop set its rows: back to one
            backend.set_rows(1)
            self._runners.pop(key, None)
        if key not in self._runners:
            self._runners[key] = self._target_settings(key, decoder_runner(
                backend, row_multiple=self.row_multiple if key == "target" else 1))
        return self._runners[key]

    def _target_settings(self, key: str, runner):
        """``runner`` with the target's settings beyond ``row_multiple``, where the runner takes them: its LM head on
        the real rows only (:attr:`head_skips_padding`) and prompt chunks where :attr:`prompts` says;
        other graphs' runners as they are."""
        if key != "target":
            return runner
        if runner.can_skip_padding_head:
            runner.head_skips_padding = self.head_skips_padding
        if self.prompts != "target" and runner.takes_prompt_graph:
            runner.prompt_backend = self._prompt_chunks.get(self.row_multiple)
        return runner

    def loop_runner(self, key: str, max_requests: int = 1, keep_features: bool = True):
        """The runner the decoding loop drives for graph ``key``: for one request the graph's one-sequence runner
        (:meth:`runner`, kept, emptied first) behind a :class:`~dspark_runtime.runners.sequence.SequenceRunner`, for a
        batch a new :func:`~dspark_runtime.runners.factory.batch_runner`; on a device always a new
        :class:`~dspark_runtime.runners.device.DeviceBatchRunner` of ``max_requests`` rows, copying target features
        back only with ``keep_features``. Raises InputError when ``max_requests`` exceeds its ``--max-batch``."""
        if key in self._device_entries:  # DeviceBatchRunner for one request too; it activates the decoder on use
            self._check_trt_rows(max_requests)
            return batch_runner(self._backends[key], max_requests=max_requests, keep_features=keep_features)
        if max_requests > 1:
            return self._target_settings(key, batch_runner(self._backends[key].activate(),
                                                  row_multiple=self.row_multiple if key == "target" else 1,
                                                  max_requests=max_requests))
        r = self._solo_runners.get(key)
        if r is None:
            r = self._solo_runners[key] = SequenceRunner(self.runner(key))
        for rid in r.requests:  # a request an interrupted call left behind
            r.remove(rid)
        return r

    def _check_trt_rows(self, rows: int) -> None:
        """Raise InputError when the TensorRT engine of a graph placed on ``trt``, or the device graph of one placed
        on ``cuda``, takes fewer than ``rows`` rows per call (its ``--max-batch``), naming the graph and the fix."""
        trt = trt_engines_run(self.manifest)
        limits = {**{k: trt[k] for k, p in self.placement.items() if p == "trt"}, **self._device_entries}
        for k in sorted(limits):
            most = int(limits[k].profile_settings["max_batch"])
            if rows > most:
                what, cmd = (("TensorRT engine", "build-trt") if self.placement[k] == "trt"
                             else ("device graph", "build-cuda"))
                raise InputError(f"max_batch {rows}, but the {what} of graph {k!r} takes at most {most} rows "
                                 f"per call; use max_batch <= {most} or rebuild it with `dspark-export {cmd} "
                                 f"{self.dir} --max-batch {rows}`")

    def graph_backend(self, key: str):
        """The activated backend of graph ``key`` (``"target"``, ``"draft"``, the DSpark graph's key): an
        :class:`~dspark_runtime.backends.ort.OrtDecoder` or a TensorRT decoder. Raises KeyError for a graph the engine lacks."""
        return self._backends[key].activate()

    def encode_prompt(self, prompt, raw: bool = False) -> list:
        """Token ids for a prompt: a string (chat-templated as one user turn unless ``raw``) or a
        list of chat messages. Raises InputError on an empty prompt."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InputError("the prompt is empty; pass some text")
            text = prompt if raw else self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        elif isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InputError("the message list is empty; pass at least one message")
            text = self.tokenizer.apply_chat_template(list(prompt))
        else:
            raise InputError(f"prompt must be a string or a list of messages, not {type(prompt).__name__}")
        ids = self.tokenizer.encode(text)
        if not ids:
            raise InputError("the prompt encodes to zero tokens; pass some text")
        return ids

    def probe_row_invariance(self, *, prompt_tokens: int = 48, tokens: int = 24, seed: int = 0,
                             kernels: bool = True) -> dict:
        """Measure the smallest row multiple that makes the target graph row-count invariant here
        (:func:`~dspark_runtime.machine.row_invariance.probe_target_rows`) and use it from now on
        (``self.row_multiple``, ``self.head_skips_padding``). When no candidate is invariant the padding stays 1 and the result's ``row_multiple`` is None. Returns the probe's dict plus
        "backend" and "target_sha256". Raises InputError on the TensorRT backend (padding is refused there)."""
        if self.backend != "ort":
            raise InputError("the row probe is for the ONNX Runtime backend (TensorRT runs unpadded); load with "
                             "backend='ort'")
        t = self.manifest.graphs["target"]
        res = probe_target_rows(self.runner("target"), t.spec.dims.vocab_size, self._backends["target"].threads,
                                prompt_tokens=prompt_tokens, tokens=tokens, seed=seed, kernels=kernels,
                                attention_rows=attention_rows_per_query(t.model_config or {}))
        res.update(backend=self.backend, target_sha256=target_sha256(self.manifest))
        self.row_multiple = res["row_multiple"] or 1
        self.head_skips_padding = bool(res["head_skips_padding"])
        self._target_settings("target", self.runner("target")).row_multiple = self.row_multiple
        return res

    def profile(self, *, max_tokens: int | None = None, context: int = 256, repeats: int = 3,
                draft_rows=(1, 2, 4, 8)) -> dict:
        """Re-measure the round cost table on this machine (``--profile-on-load``) and use it from now on
        (in memory; ``dspark-export profile`` writes it to the manifest). ``context``: cached positions, an int
        (one bucket, quick) or a sequence of context buckets. ``max_tokens`` defaults to
        8 x (block size + 1) so batched rounds of 8 requests are covered. Returns the table
        (see :func:`dspark_runtime.machine.cost_profile.profile_runtime`)."""
        if max_tokens is None:
            ds = self.manifest.speculation.dspark
            max_tokens = 8 * ((ds.block_size if ds is not None else self.default_draft_length) + 1)
        table = profile_runtime(self, max_tokens=max_tokens, context=context, repeats=repeats, draft_rows=draft_rows)
        self.manifest.speculation.cost_table = table
        return table

    def batch(self, *, draft: str | None = "auto", draft_length: int | str | None = None,
              draft_confidence: float | None = None, draft_confidence_rule: str = "survival", max_batch: int = 8,
              prefill_budget: int | str = "auto", draft_skip: bool | None = None):
        """The decoding loop (:class:`~dspark_runtime.decoding.loop.DecodingLoop`) over this engine: requests join and
        leave between rounds, one verifier pass per round for all of them; :meth:`generate` is a loop of one.

        Args:
            draft, draft_confidence, draft_confidence_rule: as :meth:`generate`.
            draft_length: γ (int), "auto" (the heuristic schedule per request), "scheduled" (DSpark or the router:
                the paper's Algorithm 1 with the manifest's cost table), or None for the default (a DSpark block;
                the manifest's draft length otherwise).
            max_batch: most requests decoding at once (1: the single-request runner, bit-exact row padding; on
                TensorRT at most the engine's ``--max-batch``).
            prefill_budget: prompt tokens fed per round while other requests decode (chunked prefill): an integer
                >= 1, or "auto" (from the cost table at each round's cached positions, 64 without one; a target on
                TensorRT: its prefill chunk); :class:`~dspark_runtime.decoding.settings.LoopSettings`.
            draft_skip: whether rounds skip the drafting pass when drafts are not expected to pay
                (:mod:`dspark_runtime.scheduling.draft_skip`; needs the profiled cost table). None: in scheduled mode
                only; ``dspark serve`` passes True. The output is the same either way.
        Returns the loop; ``submit(prompt_ids, ...)`` then ``run()`` or ``step()``; its ``default_gamma`` /
        ``default_adaptive`` are what ``submit`` uses unless told.
        Raises InputError for bad arguments, a drafter the engine lacks, "scheduled" without a cost table, or a
        ``max_batch`` beyond a TensorRT engine's rows.
        """
        kind = self.resolve_draft(draft)
        settings = self.drafters.loop_settings(kind, draft == "auto", draft_length, max_batch, prefill_budget,
                                               draft_skip, self.default_draft_length)
        self._check_trt_rows(settings.max_batch)
        target = self.loop_runner("target", settings.max_batch, keep_features=self.drafters.reads_target_features(kind))
        if settings.max_batch > 1 and not target.batch_invariant and not self._warned_packed:
            self._warned_packed = True
            warnings.warn(f"{self.dir}: the target graph has the growing KV layout, so batched requests are packed into "
                          "one row and a request's greedy output can depend on which requests share its rounds (ONNX "
                          "Runtime's CPU kernels round a packed row differently with its neighbours; "
                          "benchmarks/batch_invariance.py); alone (max_batch=1) it is exact. Rebuild with "
                          "`dspark-export build --kv-layout scatter` for batch-independent output", stacklevel=2)
        drafter = self.drafters.drafter(kind, target, draft_confidence, draft_confidence_rule, settings.max_batch,
                                        prefix_cache=self.prefix_cache,
                                        cost_table=settings.cost_table if settings.mode == "scheduled" else None)
        return DecodingLoop(target, drafter, settings, eos_ids=self.eos_ids, decode=self.tokenizer.decode,
                            prefix_cache=self.prefix_cache)

    def completion_text(self, token_ids: list, finish_reason: str | None, stop) -> str:
        """The text of generated ``token_ids``; for ``finish_reason == "stop"`` cut before the stop string that
        ended it (:func:`~dspark_runtime.decoding.request.cut_at_stop`)."""
        text = self.tokenizer.decode(token_ids)
        return cut_at_stop(text, stop) if finish_reason == "stop" else text

    def _result(self, req, stop) -> GenerationResult:
        """A finished request as a GenerationResult (its text cut before the stop string that ended it)."""
        text = self.completion_text(req.token_ids, req.finish_reason, stop)
        req.stats.placement = format_placement(self.placement)
        return GenerationResult(text=text, token_ids=req.token_ids, finish_reason=req.finish_reason, stats=req.stats,
                                logprobs=req.kept_logprobs)

    def compile_grammar(self, response_format: dict | None):
        """A fresh :class:`~dspark_runtime.decoding.grammar.Grammar` for an OpenAI ``response_format``
        (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": ...}}``), or None for
        None / ``{"type": "text"}``. Raises InputError (GrammarError) for an invalid or unsupported format or
        schema, or when the ``grammar`` extra (llguidance) is not installed."""
        if response_format is None or (isinstance(response_format, dict) and response_format.get("type") == "text"):
            return None
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.dir / self.manifest.tokenizer["dir"] / "tokenizer.json",
                                             self.manifest.graphs["target"].spec.dims.vocab_size, self.eos_ids)
        return self._grammars.compile(response_format)

    def generate_batch(self, prompts: list, *, max_new_tokens: int = 128, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, draft: str | None = "auto",
                       draft_length: int | str | None = None, draft_confidence: float | None = None,
                       draft_confidence_rule: str = "survival", seed: int | None = None, stop: list | None = None,
                       raw: bool = False, max_batch: int = 8, prefill_budget: int | str = "auto",
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                       logprobs: int | None = None, response_format: dict | None = None) -> list:
        """Generate completions for several prompts together (continuous batching, one verifier pass per
        round for all active requests). Arguments as :meth:`generate` (``prefill_budget`` as :meth:`batch`); request i
        uses seed ``seed + i``
        when a seed is given. Returns one GenerationResult per prompt, in order; ``stats`` are per
        request (its tokens/s is its own rate while sharing the batch). The loop's aggregate
        :class:`~dspark_runtime.decoding.request.BatchStats` is ``self.last_batch_stats``.
        Raises InputError for bad arguments or an empty prompt list."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InputError("prompts must be a non-empty list of prompts")
        params = check_request(max_new_tokens, temperature, top_k, top_p, stop, presence_penalty, frequency_penalty,
                               repetition_penalty)
        ids = [self.encode_prompt(p, raw=raw) for p in prompts]
        grammars = [self.compile_grammar(response_format) for _ in ids]
        gen = self.batch(draft=draft, draft_length=draft_length, draft_confidence=draft_confidence,
                         draft_confidence_rule=draft_confidence_rule, max_batch=max_batch, prefill_budget=prefill_budget)
        reqs = [gen.submit(x, max_new_tokens=max_new_tokens, params=params, logprobs=logprobs, grammar=g,
                           seed=None if seed is None else seed + i, stop=stop) for i, (x, g) in enumerate(zip(ids, grammars))]
        gen.run()
        self.last_batch_stats = gen.stats
        return [self._result(r, stop) for r in reqs]

    def generate(self, prompt, *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, draft: str | None = "auto", draft_length: int | str | None = None,
                 draft_confidence: float | None = None, draft_confidence_rule: str = "survival",
                 seed: int | None = None, stop: list | None = None, raw: bool = False,
                 stream: Callable[[str], None] | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, logprobs: int | None = None,
                 response_format: dict | None = None) -> GenerationResult:
        """Generate a completion.

        Args:
            prompt: text (wrapped in the chat template unless ``raw``) or chat messages.
            max_new_tokens: > 0.
            temperature, top_k, top_p: sampling; temperature 0 is greedy (argmax).
            draft: "auto" (:meth:`auto_draft`), "router" (per round, n-gram lookup or the engine's DSpark/LM drafter,
                whichever is expected to commit more; :mod:`dspark_runtime.drafting.router`), "dspark", "eagle3"
                (the EAGLE-3 drafter), "lm" (a standalone draft LM), "draft" (whichever the engine has), "ngram" (prompt lookup, no weights), or
                None/"none" for target-only decoding.
            draft_length: draft tokens per round (gamma >= 1), "auto" for the heuristic schedule (+2 after a fully
                accepted block, -1 otherwise), or "scheduled" (DSpark or the router): per round, the verify length
                that maximises expected tokens/s (paper Algorithm 1 with the profiled cost table). Default: the
                manifest's (DSpark, and the router over DSpark: its block size).
            draft_confidence: static-threshold baseline (0..1). Draft LM: end a block after the first draft token
                whose probability is below it. DSpark: cut before the first position whose calibrated prefix
                survival falls below it. None = the full block.
            draft_confidence_rule: how the DSpark drafter applies ``draft_confidence``: "survival" (ours, above) or
                "deepspec" (each position's own uncalibrated confidence). Other drafters: "survival" only.
            seed: RNG seed for sampling (same seed, same output).
            stop: strings that end generation (excluded from the text).
            stream: called with each new piece of text as tokens are committed.
            presence_penalty, frequency_penalty (in [-2, 2]), repetition_penalty (> 0): applied to the target's
                distribution in verification too, so speculative output stays the target's
                (:mod:`dspark_runtime.decoding.penalties`).
            logprobs: None, or how many alternatives (0..20) to list beside each generated token's log-probability
                (the target's raw distribution: :mod:`dspark_runtime.decoding.logprobs`); in ``result.logprobs``.
            response_format: an OpenAI ``response_format`` (``{"type": "json_object"}`` or ``{"type":
                "json_schema", "json_schema": {"schema": {...}}}``): output constrained by a grammar
                (:meth:`compile_grammar`; the ``grammar`` extra), identical with and without speculation.

        Returns a GenerationResult (text, token_ids, finish_reason, stats, logprobs).
        Raises InputError for out-of-range arguments, an empty prompt or an invalid ``response_format``.
        """
        params = check_request(max_new_tokens, temperature, top_k, top_p, stop, presence_penalty, frequency_penalty,
                               repetition_penalty)
        grammar = self.compile_grammar(response_format)
        gen = self.batch(draft=draft, draft_length=draft_length, draft_confidence=draft_confidence,
                         draft_confidence_rule=draft_confidence_rule, max_batch=1)
        ids = self.encode_prompt(prompt, raw=raw)
        text = None if stream is None else TextStream(self.tokenizer.decode, stream, stop)
        req = gen.submit(ids, max_new_tokens=max_new_tokens, params=params, seed=seed, stop=stop,
                         on_tokens=None if text is None else text.on_tokens, logprobs=logprobs, grammar=grammar)
        gen.run()
        res = self._result(req, stop)
        if text is not None:
            text.flush(res.text)
        return res
