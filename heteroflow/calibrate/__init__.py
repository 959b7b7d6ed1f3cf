"""calibrate: fit the cost model's per device type factors to measured runs (`heteroflow calibrate`).

`runs` reads and checks metrics files and measurements files, `fit` fits the factors (numpy, no torch),
`command` prints and writes the result. The factors themselves, their file and how they scale the cost
model live in `heteroflow.stagemap.calibration`, which the planner reads; nothing in stagemap imports this
package.
"""

from heteroflow.calibrate.fit import Fit, fit_calibration
from heteroflow.calibrate.runs import Run, load_runs

__all__ = ["Fit", "Run", "fit_calibration", "load_runs"]
