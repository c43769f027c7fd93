// strata-plot: the picture of a run (strata/run_plot.h) from its strata-train --log-json file,
// finished or still being written: loss and validation loss, learning rate, gradient norm,
// tokens/s and the bytes each tier moved, over the steps, as one SVG a browser shows.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <string>

#include "strata/error.h"
#include "strata/run_plot.h"
#include "tool_main.h"

int main(int argc, char** argv) {
  std::string log, out, title;
  bool overwrite = false;
  CLI::App app{
      "strata-plot: draw a strata-train --log-json file as one self-contained SVG (loss and val "
      "loss, lr, gradient norm, tokens/s, bytes per tier per step over the steps).\n"
      "A log still being written is fine: its cut-short last line is left out; run again to "
      "redraw (strata-train --plot FILE.svg redraws after every step itself)."};
  app.add_option("log", log, "the JSONL file strata-train --log-json FILE wrote")->required();
  app.add_option("-o,--out", out, "the SVG file to write (open it in a browser)")->required();
  app.add_option("--title", title, "the picture's title (default: the log's file name)");
  app.add_flag("--overwrite", overwrite, "replace an existing --out file");
  return strata::tools::run_tool(
      "strata-plot", app, argc, argv, strata::tools::ToolRuns::files, [&] {
        const std::vector<strata::RunRecord> steps = strata::read_run_log(log);
        std::error_code ec;
        STRATA_REQUIRE(!std::filesystem::equivalent(log, out, ec),
                       "-o {} is the log itself: give another file for the picture", out);
        strata::require_output_file("-o", out, overwrite);
        if (title.empty())
          title = "strata-train run: " + std::filesystem::path(log).filename().string();
        strata::write_run_plot(out, strata::run_plot_svg(steps, title));
        std::printf("strata-plot: %s: %zu steps (%lld to %lld) drawn\n", out.c_str(), steps.size(),
                    (long long)steps.front().step, (long long)steps.back().step);
        return 0;
      });
}
