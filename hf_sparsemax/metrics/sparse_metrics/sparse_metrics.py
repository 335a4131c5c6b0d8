"""`evaluate` module: epsilon-perplexity, sparsemax score, Jensen-Shannon and accuracy of sparse models.

Load it offline, by path: ``evaluate.load(hf_sparsemax.metrics.METRIC_PATH)``.
Inputs per token (see ``hf_sparsemax.metrics.token_stats``): ``target_prob``
(probability of the reference token), ``sq_norm`` (squared L2 norm of the
distribution), ``hit`` (1 if the argmax is the reference) and ``support``
(number of non-zero probabilities). ``compute(..., vocab_size=V, epsilon=1e-6)``.
"""

import datasets
import evaluate

from hf_sparsemax.metrics import summarize

_DESCRIPTION = __doc__
_CITATION = """@inproceedings{martins2020sparse, title={Sparse Text Generation},
author={Martins, Pedro Henrique and Marinho, Zita and Martins, Andr{\\'e} F. T.}, booktitle={EMNLP}, year={2020}}"""


class SparseMetrics(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_DESCRIPTION,
            features=datasets.Features(
                {name: datasets.Value("float32") for name in ("target_prob", "sq_norm", "hit", "support")}
            ),
        )

    def _compute(self, target_prob, sq_norm, hit, support, vocab_size=None, epsilon=1e-6):
        if vocab_size is None:
            raise ValueError("pass vocab_size=... (the size of the output vocabulary) to compute()")
        return summarize(target_prob, sq_norm, hit, support, vocab_size=vocab_size, epsilon=epsilon)
