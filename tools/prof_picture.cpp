// strata-prof's picture: the measured step's trace as per-lane intervals, and the SVG of the best
// candidate's step per resource lane (predicted, and measured when validated) with the bytes
// per tier of the top candidates.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>

#include "prof.h"
#include "strata/error.h"
#include "strata/paths.h"

namespace strata::prof {
namespace {

// The resource lane a traced span ran on (kCount: none the model has).
Resource lane_of(const TraceSpan& sp) {
  if (sp.name == "wait_event" || sp.name == "free" || sp.name == "prof_stamp")
    return Resource::kCount;
  if (sp.name.starts_with("tp.")) return Resource::kTp;  // the model's, on the compute stream
  if (sp.name == "copy_h2d") return Resource::kH2D;
  if (sp.name == "copy_d2h") return Resource::kD2H;
  if (sp.lane.starts_with("nvme")) return Resource::kNvme;
  // The host's optimizer work, as the model puts it on the cpu lane: AdamW, the gradients' sums
  // of squares, the updated weights copied out, gradients added.
  if (sp.name == "cpu_adamw" || sp.name == "cpu_sum_squares" || sp.name == "cpu_copy_w" ||
      sp.name == "grad_accumulate")
    return Resource::kCpu;
  if (sp.lane == "compute" || (sp.lane == "optimizer" && sp.name == "adamw"))
    return Resource::kCompute;
  const std::string_view op =
      sp.name.starts_with("dp.") ? std::string_view(sp.name).substr(3) : std::string_view(sp.name);
  if (op.starts_with("all_gather") || op.starts_with("reduce_scatter") ||
      op.starts_with("all_reduce"))
    return Resource::kComm;
  return Resource::kCount;
}

}  // namespace

// ---- the trace of a measured step, per resource lane ----
std::vector<Interval> measured_schedule(const std::vector<TraceSpan>& spans) {
  std::vector<Interval> out;
  std::int64_t t0 = INT64_MAX;
  for (const auto& sp : spans) t0 = std::min(t0, sp.start_ns);
  for (const auto& sp : spans) {
    const Resource r = lane_of(sp);
    if (r == Resource::kCount || sp.end_ns <= sp.start_ns) continue;
    out.push_back({r, double(sp.start_ns - t0) / 1e9, double(sp.end_ns - t0) / 1e9, sp.name,
                   sp.lane, sp.bytes});
  }
  return out;
}

namespace {

std::string svg_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '&')
      o += "&amp;";
    else
      o += c;
  }
  return o;
}

}  // namespace

// ---- the picture ----
void write_svg(const std::string& path, const Candidate& best,
               const std::vector<Interval>* measured, double measured_step_s,
               const std::vector<Candidate>& top) {
  const char* colors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2",
                          "#59a14f", "#edc948", "#b07aa1"};  // one a lane
  static_assert(std::size(colors) == std::size_t(Resource::kCount), "a colour for every lane");
  const int lanes = int(Resource::kCount);
  const double width = 1000, left = 90, lane_h = 22;
  std::string body;
  double y = 30;
  // One time scale for both timelines, so the predicted and the measured step compare by eye.
  const double span_s = std::max(best.prediction.step_s, measured ? measured_step_s : 0.0);
  auto timeline = [&](const std::vector<Interval>& sched, double step_s, const std::string& title) {
    body += fmt::format("<text x='10' y='{}' font-weight='bold'>{}</text>\n", y, svg_escape(title));
    y += 10;
    const double scale = (width - left - 20) / std::max(span_s, 1e-9);
    for (int r = 0; r < lanes; ++r) {
      const double ly = y + r * lane_h;
      body += fmt::format("<text x='10' y='{}'>{}</text>\n", ly + 15, resource_name(Resource(r)));
      body += fmt::format("<rect x='{}' y='{}' width='{}' height='{}' fill='#f4f4f4'/>\n", left,
                          ly + 2, width - left - 20, lane_h - 4);
    }
    for (const auto& iv : sched) {
      const double ly = y + int(iv.lane) * lane_h;
      const double x = left + iv.start_s * scale,
                   w = std::max(0.5, (iv.end_s - iv.start_s) * scale);
      body += fmt::format(
          "<rect x='{:.1f}' y='{}' width='{:.1f}' height='{}' fill='{}'><title>{} {:.2f}-{:.2f} "
          "ms</title></rect>\n",
          x, ly + 2, w, lane_h - 4, colors[int(iv.lane)], svg_escape(iv.what), iv.start_s * 1e3,
          iv.end_s * 1e3);
    }
    y += lanes * lane_h;
    body += fmt::format(
        "<text x='{}' y='{}'>0</text><text x='{:.1f}' y='{}' text-anchor='end'>{:.1f} ms</text>\n",
        left, y + 14, left + step_s * scale, y + 14, step_s * 1e3);
    y += 36;
  };
  timeline(best.prediction.schedule, best.prediction.step_s,
           fmt::format("predicted step: {} ({:.1f} ms)", best.label, best.prediction.step_s * 1e3));
  if (measured)
    timeline(*measured, measured_step_s,
             fmt::format("measured step (trace of the same configuration, {:.1f} ms)",
                         measured_step_s * 1e3));
  // bytes per tier of the top candidates
  body += fmt::format(
      "<text x='10' y='{}' font-weight='bold'>bytes per tier (planner), top candidates</text>\n",
      y);
  y += 12;
  double maxb = 1;
  for (const auto& c : top)
    maxb = std::max(
        {maxb, double(c.plan.device_bytes), double(c.plan.host_bytes), double(c.plan.nvme_bytes)});
  const char* tier_names[] = {"device", "host", "nvme"};
  for (std::size_t i = 0; i < top.size(); ++i) {
    const Candidate& c = top[i];
    const double vals[] = {double(c.plan.device_bytes), double(c.plan.host_bytes),
                           double(c.plan.nvme_bytes)};
    body += fmt::format("<text x='10' y='{}'>#{} {}</text>\n", y + 12, i + 1, svg_escape(c.label));
    y += 16;
    for (int t = 0; t < 3; ++t) {
      const double w = vals[t] / maxb * (width - left - 160);
      body += fmt::format(
          "<text x='20' y='{}'>{}</text><rect x='{}' y='{}' width='{:.1f}' height='12' fill='{}'/>"
          "<text x='{:.1f}' y='{}'>{}</text>\n",
          y + 11, tier_names[t], left, y + 1, w, colors[t], left + w + 6, y + 11, human(vals[t]));
      y += 15;
    }
    y += 6;
  }
  const std::string svg = fmt::format(
                              "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' "
                              "font-family='sans-serif' "
                              "font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n",
                              width, y + 10) +
                          body + "</svg>\n";
  const int err = write_output(path, svg);  // (a stream, as /dev/stdout, written into)
  STRATA_REQUIRE(err == 0, "--svg {}: cannot be written: {}", path, std::strerror(err));
}

}  // namespace strata::prof
