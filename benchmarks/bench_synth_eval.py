"""Speed of the synthetic-task evaluation: one batched forward per sample vs one forward per answer.

    python benchmarks/bench_synth_eval.py [--batch-size 8] [--naive-samples 148|all] [--repeats 3] [--threads N]

A small random DCFormer (2 layers, d_model 64) with a word-level tokenizer over the released file scores
the 888 released samples with `evaluate` (batched, one forward per sample). `evaluate_naive` (one forward
per answer, over the tokens up to the answer) is timed on every 6th sample by default and its time
extrapolated per sample to the 888; `--naive-samples all` times it on all of them. Each time is the
fastest of `--repeats` runs (the machine may be shared). On the samples both score, the results are compared.
"""

from __future__ import annotations

import argparse
import time

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.synth.catalog import data_dir
from dcinterp.synth.evaluate import evaluate, evaluate_naive, load_samples, parse_sample


def word_level_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]")


def small_model(tokenizer, device: str) -> HookedDCFormer:
    torch.manual_seed(0)
    cfg = DCFormerConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_mlp=256, d_vocab=len(tokenizer))
    return HookedDCFormer(cfg, tokenizer=tokenizer).to(device)


def timed(function, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--naive-samples",
        default="148",
        help="how many samples (spread evenly) to time the naive evaluation on, or 'all'",
    )
    parser.add_argument("--repeats", type=int, default=3, help="time each evaluation this many times, keep the fastest")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    samples = load_samples(data_dir() / "synthetic_dataset.jsonl")
    tokenizer = word_level_tokenizer([parse_sample(s).plain_text for s in samples])
    model = small_model(tokenizer, args.device)
    n_naive = len(samples) if args.naive_samples == "all" else int(args.naive_samples)
    naive_subset = samples[:: max(1, len(samples) // n_naive)][:n_naive]

    evaluate(model, samples[:8], batch_size=args.batch_size, progress=False)  # warm-up
    batched_times, naive_times = [], []
    for _ in range(args.repeats):  # alternated, so that both see the same load on a shared machine
        batched, seconds = timed(evaluate, model, samples, batch_size=args.batch_size, progress=False)
        batched_times.append(seconds)
        naive, seconds = timed(evaluate_naive, model, naive_subset)
        naive_times.append(seconds)
    batched_seconds, naive_seconds = min(batched_times), min(naive_times)
    naive_all_seconds = naive_seconds * len(samples) / len(naive_subset)

    scored_by_both = batched[batched["sample"].isin(naive["sample"])].reset_index(drop=True)
    max_nll_difference = (scored_by_both["nll"] - naive["nll"]).abs().max()
    same_predictions = (scored_by_both["predicted"] == naive["predicted"]).all()

    print(
        f"model: 2 layers, d_model 64, DCMHA, vocab {len(tokenizer)}; device {args.device}, "
        f"{torch.get_num_threads()} threads; {len(samples)} samples, {len(batched)} answers; "
        f"fastest of {args.repeats} runs"
    )
    print(
        f"batched evaluate (batch size {args.batch_size}, one forward per sample): {batched_seconds:.2f} s "
        f"for {len(samples)} samples"
    )
    how = (
        "measured"
        if len(naive_subset) == len(samples)
        else f"extrapolated from {naive_seconds:.2f} s on {len(naive_subset)} samples"
    )
    print(
        f"naive evaluate_naive (one forward per answer): {naive_all_seconds:.2f} s for {len(samples)} samples ({how})"
    )
    print(f"speed-up: {naive_all_seconds / batched_seconds:.1f}x")
    print(
        f"on the {len(naive_subset)} samples both scored: max |nll difference| {max_nll_difference:.2e}, "
        f"same predictions: {same_predictions}"
    )


if __name__ == "__main__":
    main()
