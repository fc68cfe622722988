"""The reusable recipes of the executable book on torch.func, as one package.

Every function here is the one a chapter teaches in a cell tagged `recipe`, unchanged
(tests/test_package.py checks that the two stay identical):

- transforms ("`vmap` basics", "Jacobians and Hessians"): pairwise, jacobian_via_vjp, hvp
- per_sample ("Per-sample gradients", "Real models"): per_sample_grads, clip_and_noise, noised_mean, per_sample_grad_norms,
  clipped_noisy_gradient, clipped_grad_sum
- output_jacobians ("Output-wise Jacobians"): output_jacobian, split_by_parameter, empirical_ntk
- ensembles ("Model ensembling"): stack_models
- curvature ("Curvature"): param_hvp, ggn_vp, empirical_fisher_vp, ggn_diagonal, hessian_trace,
  hessian_diagonal, top_hessian_eigenvalues (returning Eigenpairs), gauss_newton_step, conjugate_gradient,
  influence_scores
- migration ("Migrating from functorch"): named_like_parameters
- PathReport, which path a recipe call took ("fast", "vmap", "unroll" or "loop") and why (from the private
  _trace module, shared by the per-example recipes)
"""

from ._trace import PathReport
from .curvature import (
    Eigenpairs,
    conjugate_gradient,
    empirical_fisher_vp,
    gauss_newton_step,
    ggn_diagonal,
    ggn_vp,
    hessian_diagonal,
    hessian_trace,
    influence_scores,
    param_hvp,
    top_hessian_eigenvalues,
)
from .ensembles import stack_models
from .migration import named_like_parameters
from .output_jacobians import empirical_ntk, output_jacobian, split_by_parameter
from .per_sample import (
    clip_and_noise,
    clipped_grad_sum,
    clipped_noisy_gradient,
    noised_mean,
    per_sample_grad_norms,
    per_sample_grads,
)
from .transforms import hvp, jacobian_via_vjp, pairwise

__version__ = "0.1.0"

__all__ = [
    "Eigenpairs",
    "PathReport",
    "clip_and_noise",
    "clipped_grad_sum",
    "clipped_noisy_gradient",
    "conjugate_gradient",
    "empirical_fisher_vp",
    "empirical_ntk",
    "gauss_newton_step",
    "ggn_diagonal",
    "ggn_vp",
    "hessian_diagonal",
    "hessian_trace",
    "hvp",
    "influence_scores",
    "jacobian_via_vjp",
    "named_like_parameters",
    "noised_mean",
    "output_jacobian",
    "pairwise",
    "param_hvp",
    "per_sample_grad_norms",
    "per_sample_grads",
    "split_by_parameter",
    "stack_models",
    "top_hessian_eigenvalues",
]
