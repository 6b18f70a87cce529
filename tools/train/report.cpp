#include "train/report.h"

#include <apex/io.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace apex::train {

std::string compare_table(const std::vector<Summary>& runs, const std::vector<double>& speedups) {
  std::ostringstream out;
  char line[256];
  std::snprintf(line, sizeof(line), "%-6s %11s %8s %10s %11s %9s %8s %11s\n", "level", "samples/s",
                "speedup", "peak MiB", "train loss", "test acc", "skipped", "loss scale");
  out << line;
  const double base = runs.empty() ? 1.0 : runs.front().samples_per_s;
  for (size_t i = 0; i < runs.size(); ++i) {
    const Summary& r = runs[i];
    const double speedup =
        i < speedups.size() ? speedups[i] : r.samples_per_s / std::max(base, 1e-9);
    std::snprintf(line, sizeof(line), "%-6s %11.1f %7.2fx %10.0f %11.4f %8.1f%% %8lld %11g\n",
                  r.level.c_str(), r.samples_per_s, speedup, r.peak_rss_mb, r.final_loss,
                  100.0 * r.test_accuracy, static_cast<long long>(r.skipped_steps), r.loss_scale);
    out << line;
  }
  return out.str();
}

namespace {

double median(std::vector<double> v) {
  TORCH_CHECK(!v.empty(), "apex-train: the median of no rounds");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

double Rounds::median_rate(size_t level) const { return median(rate.at(level)); }
double Rounds::median_ratio(size_t level) const { return median(ratio.at(level)); }

Rounds run_in_rounds(size_t levels, int64_t rounds, const std::function<double(size_t)>& run,
                     const std::function<void(int64_t, const Rounds&)>& after_round) {
  Rounds out;
  out.rate.resize(levels);
  out.ratio.resize(levels);
  for (int64_t r = 0; r < rounds; ++r) {
    for (size_t j = 0; j < levels; ++j) {
      const size_t i = (j + static_cast<size_t>(r)) % levels;
      out.rate[i].push_back(run(i));
    }
    for (size_t i = 0; i < levels; ++i) {
      out.ratio[i].push_back(out.rate[i].back() / std::max(out.rate[0].back(), 1e-9));
    }
    if (after_round) after_round(r, out);
  }
  return out;
}

namespace {

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') {
      out += "&lt;";
    } else if (c == '>') {
      out += "&gt;";
    } else if (c == '&') {
      out += "&amp;";
    } else if (c == '"') {
      out += "&quot;";
    } else {
      out += c;
    }
  }
  return out;
}

// A "nice" tick step near range / 5.
double tick_step(double range) {
  const double raw = range / 5.0;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1.0 : f < 3.5 ? 2.0 : f < 7.5 ? 5.0 : 10.0) * mag;
}

}  // namespace

void write_svg(const std::string& path, const std::vector<Summary>& runs) {
  constexpr double kW = 760, kH = 440, kLeft = 70, kRight = 150, kTop = 40, kBottom = 50;
  const double pw = kW - kLeft - kRight;
  const double ph = kH - kTop - kBottom;
  double max_step = 1;
  double lo = INFINITY;
  double hi = -INFINITY;
  for (const auto& r : runs) {
    for (const auto& p : r.curve) {
      max_step = std::max(max_step, static_cast<double>(p.step));
      if (std::isfinite(p.loss)) {
        lo = std::min(lo, p.loss);
        hi = std::max(hi, p.loss);
      }
    }
  }
  if (!std::isfinite(lo)) {
    lo = 0;
    hi = 1;
  }
  if (hi - lo < 1e-9) hi = lo + 1;
  const double ystep = tick_step(hi - lo);
  lo = std::floor(lo / ystep) * ystep;
  hi = std::ceil(hi / ystep) * ystep;
  const double xstep = tick_step(max_step);
  auto px = [&](double step) { return kLeft + pw * step / max_step; };
  auto py = [&](double loss) { return kTop + ph * (1.0 - (loss - lo) / (hi - lo)); };
  static const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  std::ostringstream svg;
  char buf[256];
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  std::snprintf(buf, sizeof(buf),
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"12\">\n",
                kW, kH, kW, kH);
  svg << buf << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  const std::string title = runs.empty() ? "apex-train" : runs.front().model;
  std::snprintf(buf, sizeof(buf), "<text x=\"%.0f\" y=\"22\" font-size=\"14\">", kLeft);
  svg << buf << escape("train loss: " + title) << "</text>\n";
  for (double y = lo; y <= hi + ystep * 1e-6; y += ystep) {
    std::snprintf(buf, sizeof(buf),
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                  kLeft, py(y), kLeft + pw, py(y), kLeft - 6, py(y) + 4, y);
    svg << buf;
  }
  for (double x = 0; x <= max_step + xstep * 1e-6; x += xstep) {
    std::snprintf(buf, sizeof(buf),
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                  "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n",
                  px(x), kTop, px(x), kTop + ph, px(x), kTop + ph + 16, x);
    svg << buf;
  }
  std::snprintf(buf, sizeof(buf),
                "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                "stroke=\"black\"/>\n<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step"
                "</text>\n",
                kLeft, kTop, pw, ph, kLeft + pw / 2, kH - 12);
  svg << buf;
  for (size_t i = 0; i < runs.size(); ++i) {
    const char* color = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
    svg << "<polyline class=\"curve\" data-level=\"" << escape(runs[i].level)
        << "\" fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" points=\"";
    for (const auto& p : runs[i].curve) {
      if (!std::isfinite(p.loss)) continue;
      std::snprintf(buf, sizeof(buf), "%.1f,%.1f ", px(static_cast<double>(p.step)), py(p.loss));
      svg << buf;
    }
    svg << "\"/>\n";
    const double ly = kTop + 10 + 20.0 * static_cast<double>(i);
    std::snprintf(buf, sizeof(buf),
                  "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                  "stroke-width=\"3\"/><text x=\"%.1f\" y=\"%.1f\">",
                  kLeft + pw + 15, ly, kLeft + pw + 40, ly, color, kLeft + pw + 46, ly + 4);
    svg << buf << escape(runs[i].level) << "</text>\n";
  }
  svg << "</svg>\n";
  apex::write_file_atomic(path, svg.str());
}

}  // namespace apex::train
