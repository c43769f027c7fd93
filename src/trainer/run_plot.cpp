// The picture of a run (strata/run_plot.h): --log-json lines read back into RunRecords, and the
// records drawn as an SVG of five panels over the step. It owns no state: strata-train keeps its
// records and calls run_plot_svg after each step, strata-plot reads them from a log.
//
// Invariants the picture keeps, whatever the log holds:
//   - a value that is missing or not finite is a gap in its line, never a point at 0;
//   - a panel's axis comes only from finite values; a series that is 0 at every step is named in
//     the legend ("none" for bytes) and not drawn, and a panel with nothing to draw says why in
//     words where the axis would be;
//   - thousands of steps cost no more than the plot's width: points that fall in one pixel column
//     are kept as that column's lowest and highest (a spike stays visible).
#include "strata/run_plot.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string_view>

#include "core/utf8.h"
#include "strata/error.h"
#include "strata/json_config.h"
#include "strata/paths.h"

namespace strata {

namespace {

namespace fs = std::filesystem;

// A value of the line: a number, or none (null, absent); anything else is no step's line.
double number_or_none(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return RunRecord::kNone;
  STRATA_REQUIRE(it->is_number(), "\"{}\" is {}, not a number", key, it->dump());
  return it->get<double>();
}

}  // namespace

RunRecord run_record_from_json(const nlohmann::json& j) {
  STRATA_REQUIRE(j.is_object(), "a JSON {} where a step's object {{\"step\": ...}} belongs",
                 j.type_name());
  const auto step = j.find("step");
  STRATA_REQUIRE(step != j.end(), "a JSON object without \"step\"");
  STRATA_REQUIRE(step->is_number_integer(), "\"step\" is {}, not a whole number", step->dump());
  // (18446744073709551615 is JSON's unsigned integer: read as int64 it was step -1)
  STRATA_REQUIRE(step->is_number_unsigned() ? step->get<std::uint64_t>() <= std::uint64_t(INT64_MAX)
                                            : step->get<std::int64_t>() >= 0,
                 "\"step\" is {}, not a step number (0 to 2^63 - 1)", step->dump());
  RunRecord r;
  r.step = step->get<std::int64_t>();
  r.loss = number_or_none(j, "loss");
  r.val_loss = number_or_none(j, "val_loss");
  r.lr = number_or_none(j, "lr");
  r.grad_norm = number_or_none(j, "grad_norm");
  r.tokens_per_s = number_or_none(j, "tokens_per_s");
  r.h2d_bytes = number_or_none(j, "h2d_bytes");
  r.d2h_bytes = number_or_none(j, "d2h_bytes");
  r.nvme_read_bytes = number_or_none(j, "nvme_read_bytes");
  r.nvme_written_bytes = number_or_none(j, "nvme_written_bytes");
  const auto skipped = j.find("skipped");
  r.skipped = skipped != j.end() && skipped->is_boolean() && skipped->get<bool>();
  return r;
}

std::vector<RunRecord> read_run_log(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    STRATA_THROW(kInvalidArgument,
                 "{} is a folder: give the file strata-train --log-json FILE writes", path);
  std::ifstream f(path, std::ios::binary);
  if (!f)
    STRATA_THROW(kIo, "{} cannot be read: {}: give the file strata-train --log-json FILE writes",
                 path, std::strerror(errno));
  const std::string text{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  if (f.bad()) STRATA_THROW(kIo, "{} cannot be read: {}", path, std::strerror(errno));
  std::map<std::int64_t, RunRecord> by_step;  // a step logged twice: the later line
  std::size_t at = 0, line_no = 0;
  while (at < text.size()) {
    ++line_no;
    const std::size_t nl = text.find('\n', at);
    const bool complete = nl != std::string::npos;
    const std::string_view line(text.data() + at, (complete ? nl : text.size()) - at);
    at = complete ? nl + 1 : text.size();
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::optional<nlohmann::json> j = config::try_parse(line);
    // The last line without its newline, cut short: strata-train is writing it now.
    if (!complete && !j) {
      STRATA_REQUIRE(!by_step.empty(),
                     "{} holds no complete step: its only line ('{}') is not JSON and has no "
                     "newline; give the file of a strata-train --log-json run that has logged its "
                     "first step",
                     path, std::string(line.substr(0, 60)));
      break;
    }
    if (!j)
      STRATA_THROW(
          kInvalidArgument,
          "{}:{}: not JSON{} ('{}'): a strata-train --log-json file has one JSON object a "
          "line; give that file, or remove the line",
          path, line_no,
          config::nested_too_deep(line)
              ? fmt::format(" strata reads (nested more than {} deep)", config::kMaxJsonDepth)
              : "",
          std::string(line.substr(0, 60)));
    try {
      const RunRecord r = run_record_from_json(*j);
      by_step[r.step] = r;
    } catch (const Error& e) {
      STRATA_THROW(kInvalidArgument,
                   "{}:{}: not a step of strata-train --log-json ({}): give the file "
                   "strata-train --log-json FILE writes",
                   path, line_no, e.message());
    }
  }
  if (by_step.empty())
    STRATA_THROW(kInvalidArgument,
                 "{} holds no step yet{}: give the file of a strata-train --log-json run that has "
                 "logged its first step",
                 path, text.empty() ? " (it is empty)" : "");
  std::vector<RunRecord> out;
  out.reserve(by_step.size());
  for (auto& [step, r] : by_step) out.push_back(r);
  return out;
}

namespace {

// ---- the picture's geometry (SVG user units = CSS pixels) ----
constexpr double kWidth = 960, kLeft = 84, kRight = 24, kTitleH = 64, kPanelH = 196;
constexpr double kPlotTop = 30, kPlotH = 128;  // within a panel
constexpr int kPanels = 5;
constexpr double kHeight = kTitleH + kPanels * kPanelH + 8;
constexpr double kPlotW = kWidth - kLeft - kRight;

// Text as XML takes it: UTF-8 (a title or a log's name in Latin-1 made the file unreadable; its
// bad bytes become U+FFFD), the markup characters escaped, no control characters.
std::string xml_escape(std::string_view raw) {
  const std::string s = utf8::lossy(raw);
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '&':
        o += "&amp;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t' || c == '\n') o += c;
    }
  }
  return o;
}

// A short number for a label: 4 significant digits, no "-0"; thousands and up with a suffix
// ("12.4k", "3M": tokens/s), as far as T.
std::string num(double v) {
  if (v == 0) return "0";
  const double a = std::abs(v);
  if (a >= 1e4 && a < 1e15) {
    const char* suffix[] = {"k", "M", "G", "T"};
    int k = 0;
    while (k < 3 && a >= std::pow(1e3, k + 2)) ++k;
    return fmt::format("{:.4g}{}", v / std::pow(1e3, k + 1), suffix[k]);
  }
  return fmt::format("{:.4g}", v);
}

const char* const kByteUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};

// The binary unit (power of 1024) that labels values up to `v`.
int byte_unit(double v) {
  int k = 0;
  while (k < 6 && std::abs(v) >= std::pow(1024.0, k + 1)) ++k;
  return k;
}

// 1, 2 or 5 times a power of ten, at least `x`.
double nice_step(double x) {
  if (!(x > 0) || !std::isfinite(x)) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(x)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= x * (1 - 1e-9)) return m * p;
  return 10 * p;
}

// A value axis: its range, whether it is logarithmic, and its ticks with their labels.
struct Axis {
  double lo = 0, hi = 1;
  bool log = false;
  std::vector<std::pair<double, std::string>> ticks;

  // 0 at the bottom of the plot, 1 at its top (long double: a range near DBL_MAX).
  double frac(double v) const {
    if (log) return double((std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo)));
    return double((static_cast<long double>(v) - lo) / (static_cast<long double>(hi) - lo));
  }
};

Axis value_axis(double mn, double mx, bool bytes) {
  Axis a;
  const double base = bytes ? 1024 : 10;
  if (mn > 0 && mx / mn >= 1000) {  // three decades or more: a log axis, a tick a power
    a.log = true;
    const double lb = std::log(base);
    const double e0 = std::floor(std::log(mn) / lb + 1e-9),
                 e1 = std::ceil(std::log(mx) / lb - 1e-9);
    a.lo = std::pow(base, e0);
    a.hi = std::pow(base, std::max(e1, e0 + 1));
    const int every = std::max(1, int(std::ceil((e1 - e0) / 8)));
    for (double e = e0; e <= e1 + 1e-9; e += every) {
      const double v = std::pow(base, e);
      a.ticks.emplace_back(v, bytes ? fmt::format("1 {}", kByteUnits[std::clamp(int(e), 0, 6)])
                                    : fmt::format("1e{}", int(e)));
    }
    return a;
  }
  if (mn == mx) {  // one value: an axis around it
    const double pad = mn != 0 ? std::abs(mn) * 0.25 : 1;
    mn -= pad;
    mx += pad;
    if (bytes && mn < 0 && mx > 0) mn = 0;
  }
  const double unit = bytes ? std::pow(1024.0, byte_unit(std::max(std::abs(mn), std::abs(mx)))) : 1;
  const long double span = (static_cast<long double>(mx) - mn) / unit;
  if (!std::isfinite(double(span))) {  // beyond a double's range: the two ends alone
    a.lo = mn;
    a.hi = mx;
    a.ticks = {{mn, num(mn)}, {mx, num(mx)}};
    return a;
  }
  const double step = nice_step(double(span) / 4);
  a.lo = std::floor(mn / unit / step) * step * unit;
  a.hi = std::ceil(mx / unit / step) * step * unit;
  if (a.hi <= a.lo) a.hi = a.lo + step * unit;
  const int k = bytes ? byte_unit(std::max(std::abs(a.lo), std::abs(a.hi))) : 0;
  // Counted, not stepped: near 1e17 a double's t + 1 is t again.
  const long n = std::min(20L, std::lround((a.hi - a.lo) / unit / step));
  for (long i = 0; i <= n; ++i) {
    const double v = a.lo + double(i) * step * unit;
    if (bytes) {
      const double in_unit = v / std::pow(1024.0, k);
      a.ticks.emplace_back(
          v, v == 0 ? std::string("0") : fmt::format("{} {}", num(in_unit), kByteUnits[k]));
    } else {
      a.ticks.emplace_back(v, num(std::abs(v) < step * 1e-9 ? 0 : v));
    }
  }
  return a;
}

struct Series {
  std::string name, color;
  std::vector<double> values;  // one a record
  bool points = false;         // sparse (the evaluations): markers joined by a dashed line
};

struct Panel {
  std::string title;
  std::vector<Series> series;
  bool bytes = false;
  bool skipped_marks = false;  // the skipped steps as red lines (the loss panel)
};

class Picture {
 public:
  Picture(const std::vector<RunRecord>& steps) : steps_(steps) {
    // Steps from the first one, in whole numbers: near 2^63 a double holds no two neighbours.
    origin_ = steps.front().step;
    hi_ = double(steps.back().step - origin_);
    if (hi_ <= 0) {  // one step: an axis either side of it
      lo_ = -1;
      hi_ = 1;
    }
  }

  std::string out;

  void panel(const Panel& p, double top) {
    out += fmt::format("<g transform=\"translate(0,{})\">\n", top);
    out +=
        fmt::format(R"(<text x="{}" y="18" font-size="14" font-weight="bold" fill="#222">{}</text>)"
                    "\n",
                    kLeft, xml_escape(p.title));
    // What each series holds: its finite values, and whether any is not 0.
    double mn = INFINITY, mx = -INFINITY;
    std::vector<bool> drawn(p.series.size(), false);
    std::vector<std::string> notes(p.series.size());
    for (std::size_t i = 0; i < p.series.size(); ++i) {
      bool any = false, nonzero = false;
      for (double v : p.series[i].values) {
        if (!std::isfinite(v)) continue;
        any = true;
        nonzero = nonzero || v != 0;
      }
      if (!any) {
        notes[i] = p.series[i].points ? "none logged" : "not in the log";
        continue;
      }
      if (!nonzero) {
        notes[i] = p.bytes ? "none" : "0 at every step";
        continue;
      }
      drawn[i] = true;
      for (double v : p.series[i].values)
        if (std::isfinite(v)) mn = std::min(mn, v), mx = std::max(mx, v);
    }
    legend(p, notes);
    const double py0 = kPlotTop, py1 = kPlotTop + kPlotH;
    out += fmt::format(
        R"(<rect x="{}" y="{}" width="{}" height="{}" fill="#fcfcfc" stroke="#999" stroke-width="1"/>)"
        "\n",
        kLeft, py0, kPlotW, kPlotH);
    step_ticks(py1);
    if (mn > mx) {  // nothing to draw: say why where the axis would be
      std::string why;
      bool all_zero = true, none = true;
      for (std::size_t i = 0; i < p.series.size(); ++i) {
        all_zero = all_zero && notes[i] != "not in the log" && notes[i] != "none logged";
        none = none && (notes[i] == "not in the log" || notes[i] == "none logged");
      }
      why = all_zero
                ? (p.bytes ? "no bytes moved between these tiers at any step" : "0 at every step")
            : none ? "not in the log"
                   : "nothing but 0 and missing values";
      out += fmt::format(
          R"(<text x="{}" y="{}" font-size="14" fill="#666" text-anchor="middle">{}</text>)"
          "\n",
          kLeft + kPlotW / 2, (py0 + py1) / 2 + 5, why);
      out += "</g>\n";
      return;
    }
    const Axis a = value_axis(mn, mx, p.bytes);
    for (const auto& [v, label] : a.ticks) {
      const double y = py1 - a.frac(v) * kPlotH;
      out += fmt::format(
          R"(<line x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}" stroke="#e4e4e4" stroke-width="1"/>)"
          R"(<text x="{}" y="{:.1f}" font-size="11" fill="#333" text-anchor="end">{}</text>)"
          "\n",
          kLeft, y, kLeft + kPlotW, y, kLeft - 6, y + 4, xml_escape(label));
    }
    if (a.log)
      out += fmt::format(R"(<text x="{}" y="{}" font-size="11" fill="#666">log scale</text>)"
                         "\n",
                         kLeft + 4, py0 + 13);
    if (p.skipped_marks) skipped(py0, py1);
    for (std::size_t i = 0; i < p.series.size(); ++i)
      if (drawn[i]) line(p.series[i], a, py1);
    out += "</g>\n";
  }

 private:
  const std::vector<RunRecord>& steps_;
  // The axis spans steps origin_ + lo_ to origin_ + hi_.
  std::int64_t origin_ = 0;
  double lo_ = 0, hi_ = 1;

  double x_of(std::int64_t step) const {
    return kLeft + (double(step - origin_) - lo_) / (hi_ - lo_) * kPlotW;
  }

  // The step axis: whole steps (0 to 2^63 - 1), about eight ticks at round numbers.
  void step_ticks(double py1) {
    using Wide = __int128;
    const double every_d = std::min(4e18, std::max(1.0, nice_step((hi_ - lo_) / 8)));
    const Wide every = Wide(std::llround(every_d));
    const Wide a = std::max<Wide>(0, Wide(origin_) + Wide(std::llround(lo_)));
    const Wide b = std::min<Wide>(INT64_MAX, Wide(origin_) + Wide(std::llround(hi_)));
    int n = 0;
    for (Wide t = (a + every - 1) / every * every; t <= b && n <= 20; t += every, ++n) {
      const double x = x_of(std::int64_t(t));
      out += fmt::format(
          R"(<line x1="{:.1f}" y1="{}" x2="{:.1f}" y2="{}" stroke="#999" stroke-width="1"/>)"
          R"(<text x="{:.1f}" y="{}" font-size="11" fill="#333" text-anchor="middle">{}</text>)"
          "\n",
          x, py1, x, py1 + 4, x, py1 + 16, std::int64_t(t));
    }
    out += fmt::format(
        R"(<text x="{}" y="{}" font-size="11" fill="#666" text-anchor="end">step</text>)"
        "\n",
        kLeft + kPlotW, py1 + 30);
  }

  void legend(const Panel& p, const std::vector<std::string>& notes) {
    double x = kLeft + 260;
    for (std::size_t i = 0; i < p.series.size(); ++i) {
      const Series& s = p.series[i];
      const std::string label = notes[i].empty() ? s.name : s.name + ": " + notes[i];
      if (notes[i].empty() && s.points)
        out += fmt::format(R"(<circle cx="{}" cy="13" r="3.5" fill="{}"/>)", x + 9, s.color);
      else
        out += fmt::format(
            R"(<line x1="{}" y1="13" x2="{}" y2="13" stroke="{}" stroke-width="{}"{}/>)", x, x + 18,
            notes[i].empty() ? s.color : "#bbb", notes[i].empty() ? 2.5 : 1.5,
            notes[i].empty() ? "" : R"( stroke-dasharray="2,2")");
      out += fmt::format(R"(<text x="{}" y="17" font-size="12" fill="#333">{}</text>)"
                         "\n",
                         x + 24, xml_escape(label));
      x += 24 + 7.0 * double(label.size()) + 18;
    }
    if (p.skipped_marks) {
      const auto n =
          std::count_if(steps_.begin(), steps_.end(), [](const RunRecord& r) { return r.skipped; });
      if (n > 0)
        out += fmt::format(
            R"(<line x1="{}" y1="6" x2="{}" y2="20" stroke="#d62728" stroke-opacity="0.5" stroke-width="2"/>)"
            R"(<text x="{}" y="17" font-size="12" fill="#333">skipped step ({})</text>)"
            "\n",
            x + 9, x + 9, x + 18, n);
    }
  }

  // The skipped steps, each a faint red line across the plot (one a pixel column).
  void skipped(double py0, double py1) {
    long last = -1;
    for (const RunRecord& r : steps_) {
      if (!r.skipped) continue;
      const double x = x_of(r.step);
      if (long(x) == last) continue;
      last = long(x);
      out += fmt::format(
          R"(<line x1="{:.1f}" y1="{}" x2="{:.1f}" y2="{}" stroke="#d62728" stroke-opacity="0.35" stroke-width="1.5"/>)"
          "\n",
          x, py0, x, py1);
    }
  }

  // A series as a path with a gap at every missing value; points that share a pixel column
  // become that column's lowest and highest, in the order they came.
  void line(const Series& s, const Axis& a, double py1) {
    struct Pt {
      double x, y;
    };
    std::vector<std::vector<Pt>> runs(1);
    std::vector<Pt> markers;
    // The pixel column being gathered: its lowest and highest point and which came first.
    struct Column {
      long x = LONG_MIN;
      Pt top{}, bottom{};
      bool top_first = true, any = false;
    } c;
    const auto flush = [&] {
      if (!c.any) return;
      if (c.top.y == c.bottom.y) {
        runs.back().push_back(c.top);
      } else {
        runs.back().push_back(c.top_first ? c.top : c.bottom);
        runs.back().push_back(c.top_first ? c.bottom : c.top);
      }
      c = Column{};
    };
    for (std::size_t i = 0; i < steps_.size(); ++i) {
      const double v = s.values[i];
      if (!std::isfinite(v) || (a.log && v <= 0)) {
        if (!s.points) {  // a gap (the evaluations' line joins across steps without one)
          flush();
          if (!runs.back().empty()) runs.emplace_back();
        }
        continue;
      }
      const Pt p{x_of(steps_[i].step), py1 - a.frac(v) * kPlotH};
      if (s.points) markers.push_back(p);
      if (long(p.x) != c.x) {
        flush();
        c.x = long(p.x);
        c.top = c.bottom = p;
        c.any = true;
        continue;
      }
      // y grows downwards: the top is the highest value
      if (p.y < c.top.y) {
        c.top = p;
        c.top_first = false;
      }
      if (p.y > c.bottom.y) {
        c.bottom = p;
        c.top_first = true;
      }
    }
    flush();
    std::string d;
    for (const auto& run : runs) {
      if (run.empty()) continue;
      if (run.size() == 1 && !s.points) {  // a lone value between gaps: a dot
        out += fmt::format(R"(<circle cx="{:.1f}" cy="{:.1f}" r="2.5" fill="{}"/>)"
                           "\n",
                           run[0].x, run[0].y, s.color);
        continue;
      }
      for (std::size_t k = 0; k < run.size(); ++k)
        d += fmt::format("{}{:.1f},{:.1f}", k == 0 ? (d.empty() ? "M" : " M") : " L", run[k].x,
                         run[k].y);
    }
    if (!d.empty())
      out += fmt::format(
          R"(<path d="{}" fill="none" stroke="{}" stroke-width="{}" stroke-linejoin="round"{}/>)"
          "\n",
          d, s.color, s.points ? 1.5 : 1.8, s.points ? R"( stroke-dasharray="5,3")" : "");
    if (markers.size() <= 400)
      for (const Pt& p : markers)
        out += fmt::format(
            R"(<circle class="val" cx="{:.1f}" cy="{:.1f}" r="3.5" fill="{}" stroke="#fff" stroke-width="1"/>)"
            "\n",
            p.x, p.y, s.color);
  }
};

std::vector<double> column(const std::vector<RunRecord>& steps, double RunRecord::*field) {
  std::vector<double> v;
  v.reserve(steps.size());
  for (const RunRecord& r : steps) v.push_back(r.*field);
  return v;
}

std::string svg_open(const std::string& title) {
  return fmt::format(
      R"(<?xml version="1.0" encoding="UTF-8"?>)"
      "\n"
      R"(<svg xmlns="http://www.w3.org/2000/svg" width="{0}" height="{1}" viewBox="0 0 {0} {1}" )"
      R"(font-family="DejaVu Sans, Helvetica, Arial, sans-serif">)"
      "\n<title>{2}</title>\n"
      R"(<rect width="{0}" height="{1}" fill="#ffffff"/>)"
      "\n"
      R"(<text x="{3}" y="26" font-size="18" font-weight="bold" fill="#111">{2}</text>)"
      "\n",
      kWidth, kHeight, xml_escape(title), kLeft);
}

// The last finite value of a field, as text ("-" when none).
std::string last_of(const std::vector<RunRecord>& steps, double RunRecord::*field) {
  for (auto it = steps.rbegin(); it != steps.rend(); ++it)
    if (std::isfinite((*it).*field)) return num((*it).*field);
  return "-";
}

}  // namespace

std::string run_plot_svg(const std::vector<RunRecord>& steps, const std::string& title) {
  std::string svg = svg_open(title);
  if (steps.empty()) {
    svg += fmt::format(
        R"(<text x="{}" y="{}" font-size="16" fill="#666" text-anchor="middle">no step logged yet: this picture is redrawn after each step</text>)"
        "\n</svg>\n",
        kWidth / 2, kTitleH + 2 * kPanelH);
    return svg;
  }
  const auto n_skipped =
      std::count_if(steps.begin(), steps.end(), [](const RunRecord& r) { return r.skipped; });
  svg += fmt::format(
      R"(<text x="{}" y="48" font-size="13" fill="#444">{} {} logged, steps {} to {}; last loss {}, last val loss {}{}</text>)"
      "\n",
      kLeft, steps.size(), steps.size() == 1 ? "step" : "steps", steps.front().step,
      steps.back().step, last_of(steps, &RunRecord::loss), last_of(steps, &RunRecord::val_loss),
      n_skipped > 0 ? fmt::format("; {} skipped", n_skipped) : std::string());
  const std::vector<Panel> panels = {
      {"loss",
       {{"train loss", "#1f77b4", column(steps, &RunRecord::loss)},
        {"val loss", "#ff7f0e", column(steps, &RunRecord::val_loss), true}},
       false,
       true},
      {"learning rate", {{"lr", "#2ca02c", column(steps, &RunRecord::lr)}}},
      {"gradient norm", {{"grad norm", "#9467bd", column(steps, &RunRecord::grad_norm)}}},
      {"throughput (tokens/s)", {{"tokens/s", "#17becf", column(steps, &RunRecord::tokens_per_s)}}},
      {"bytes moved per step",
       {{"host to device", "#1f77b4", column(steps, &RunRecord::h2d_bytes)},
        {"device to host", "#ff7f0e", column(steps, &RunRecord::d2h_bytes)},
        {"NVMe read", "#2ca02c", column(steps, &RunRecord::nvme_read_bytes)},
        {"NVMe written", "#d62728", column(steps, &RunRecord::nvme_written_bytes)}},
       true},
  };
  Picture pic(steps);
  for (int i = 0; i < kPanels; ++i) pic.panel(panels[std::size_t(i)], kTitleH + i * kPanelH);
  svg += pic.out;
  svg += "</svg>\n";
  return svg;
}

void write_run_plot(const std::string& path, const std::string& svg) {
  if (written_in_place(path)) {  // /dev/null, a pipe, /dev/stdout: into it as it is
    // (a pipe no one reads, or one whose reader left, ends the picture, not the run)
    if (const int err = write_into(path, svg.data(), svg.size()); err != 0)
      STRATA_THROW(kIo, "{} cannot be written: {}", path,
                   err == ENXIO ? "a pipe no one reads"
                                : fmt::format("{}: give another path", std::strerror(err)));
    return;
  }
  const fs::path target(path);
  // (the name cut to 64 bytes: a long one with the prefix passed the file system's 255)
  const std::string tmp =
      (target.parent_path() /
       fmt::format(".tmp-{}-{}", ::getpid(), utf8::prefix(target.filename().string(), 64)))
          .string();
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr)
    STRATA_THROW(kIo,
                 "{} cannot be written (its temporary file {}: {}): give a path in a folder "
                 "you can write in",
                 path, tmp, std::strerror(errno));
  const bool wrote = std::fwrite(svg.data(), 1, svg.size(), f) == svg.size();
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;
  const int err = !wrote ? write_errno : errno;
  if (!wrote || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int why = wrote && closed ? errno : err;
    std::remove(tmp.c_str());
    STRATA_THROW(kIo, "{} cannot be written: {}: free space there or give another path", path,
                 std::strerror(why));
  }
}

}  // namespace strata
