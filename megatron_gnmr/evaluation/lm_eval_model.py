"""lm-eval-harness over our own forward: a finished run (`LoadedRun`) as an lm-eval model,
so `megatron-gnmr evaluate RUN --lm-eval TASKS` scores the model as it was trained (any
layout a launch can read, its deployed precision or `--exact`) with no export.

It answers the two log-likelihood requests the way lm-eval's own Hugging Face model (HFLM)
does, so a task's numbers are those of lm-eval on the exported model (a test holds them
equal): a continuation's summed log-probability and whether it is the greedy one, the
sequence cut from the left to the model's context (--max-position-embeddings, else
--seq-length: what export-hf declares); a document's rolling log-likelihood in disjoint
windows of that length, each window conditioned on the previous token (the
first on the prefix token: BOS where the tokenizer has one, else the end of document). Text is
encoded as HFLM encodes it on the export: with the tokenizer's own template (a Llama
tokenizer's BOS) unless lm-eval asks without, or the text already begins with the prefix
token.
Generation tasks (`generate_until`) are refused by name: the run has no sampler here.
"""

from __future__ import annotations

import torch
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from megatron_gnmr.errors import UserError
from megatron_gnmr.evaluation.loaded_run import LoadedRun


class RunAsLM(TemplateLM):
    def __init__(self, run: LoadedRun):
        super().__init__()
        self.run = run
        self.tokenizer_of_run = run.data.tokenizer
        # the context the export declares (max_position_embeddings), which HFLM reads
        self.max_length = run.config.model.max_position_embeddings or \
            run.config.model.seq_length

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_of_run.eod

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer_of_run.bos
        return bos if bos >= 0 else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        tokenizer = self.tokenizer_of_run
        if add_special_tokens is None:  # HFLM.tok_encode's rule
            prefix = tokenizer.special_text(self.prefix_token_id)
            add_special_tokens = not (prefix and string.startswith(prefix))
        return list(tokenizer.encode_as_transformers(string, add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer_of_run.decode(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(summed log-probability of the continuation, is it the greedy continuation) for
        each (strings, context ids, continuation ids), in the order given."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        rows = []
        for index, (_, context, continuation) in enumerate(requests):
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((index, whole[:-1], list(continuation)))
        rows.sort(key=lambda row: -len(row[1]))  # one padding length per batch
        batches = range(0, len(rows), self.run.batch)
        for start in tqdm(batches, desc="lm-eval log-likelihoods", disable=disable_tqdm):
            batch = rows[start: start + self.run.batch]
            width = len(batch[0][1])
            tokens = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long)
            for i, (_, inputs, _) in enumerate(batch):
                tokens[i, : len(inputs)] = torch.tensor(inputs)
            log_probs = torch.log_softmax(self.run.logits(tokens).double(), dim=-1)
            for i, (index, inputs, continuation) in enumerate(batch):
                end = len(inputs)
                scores = log_probs[i, end - len(continuation): end]
                target = torch.tensor(continuation).unsqueeze(-1)
                greedy = bool((scores.argmax(dim=-1) == target.squeeze(-1)).all())
                results[index] = (float(scores.gather(-1, target).sum()), greedy)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for number, (string,) in enumerate(req.args for req in requests):
            for window in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *window))
                owners.append(number)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self._loglikelihood_tokens(
                windows, disable_tqdm=disable_tqdm)):
            totals[owner] += log_prob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise UserError("evaluate --lm-eval: this task generates text (generate_until), which "
                        "is not built; use log-likelihood tasks (multiple choice, perplexity), "
                        "or export-hf and run lm-eval on the export")
