// A picture of a training run: the steps strata-train logs (--log-json) drawn as one
// self-contained SVG, five panels over the step — loss (and the validation loss where a step
// evaluated), learning rate, gradient norm, tokens/s, and the bytes each tier moved in the step
// (host-to-device, device-to-host, NVMe read, NVMe written). strata-train --plot rewrites it after
// every step; strata-plot draws it from a log, finished or still being written.
//
// The SVG loads nothing (no fonts, scripts, styles or links from elsewhere): a browser shows the
// file as it is. A value that is missing or not finite (a skipped step's norm, a log without
// NVMe traffic) leaves a gap, never a point at 0; a series that is 0 at every step says so in
// words instead of drawing a flat line on a made-up axis; a positive series spanning more than
// three decades gets a log axis.
//
//   std::vector<RunRecord> steps = read_run_log("run.jsonl");
//   write_run_plot("run.svg", run_plot_svg(steps, "my run"));
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace strata {

// One step as its --log-json line says it; NaN where the line has no such value (or null, which
// is how a NaN or an infinity is written).
struct RunRecord {
  static constexpr double kNone = std::numeric_limits<double>::quiet_NaN();
  std::int64_t step = 0;
  double loss = kNone, val_loss = kNone, lr = kNone, grad_norm = kNone, tokens_per_s = kNone;
  double h2d_bytes = kNone, d2h_bytes = kNone, nvme_read_bytes = kNone, nvme_written_bytes = kNone;
  bool skipped = false;  // the optimizer skipped the step (a loss-scale overflow)
};

// The record of one --log-json line, parsed. Throws strata::Error (kInvalidArgument) when `line`
// is not a JSON object with a whole-number "step" (the reason, without a location: the caller
// knows the file and the line).
RunRecord run_record_from_json(const nlohmann::json& line);

// Every step of a --log-json file, in step order (a step logged twice: the later line). A last
// line without its newline that does not parse is a line still being written and is left out;
// any other line that is not a step record is an error naming the file and the line number. A
// file that cannot be read, or holds no step, is an error saying what to give instead.
std::vector<RunRecord> read_run_log(const std::string& path);

// The picture of `steps` (in step order) as an SVG document, `title` at its top. No steps: a
// picture that says the run has logged none yet.
std::string run_plot_svg(const std::vector<RunRecord>& steps, const std::string& title);

// Writes `svg` to `path` whole or not at all: into a temporary file beside it, renamed over
// `path`, so a browser reloading it never sees half a picture. Throws strata::Error (kIo) naming
// the path and the reason; the temporary file is removed.
void write_run_plot(const std::string& path, const std::string& svg);

}  // namespace strata
