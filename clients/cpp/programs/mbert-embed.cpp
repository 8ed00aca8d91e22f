// mbert-embed: sentence embeddings of texts through a bundle served by Triton (`mbert-run serve`).
//
//   mbert-embed --url http://127.0.0.1:8000 --model NAME [--timeout SECONDS] [--details] [TEXT ...]
//
// Texts are the TEXT arguments, or else the lines of standard input (a trailing "\r" is dropped).
// Prints one JSON array of floats per text, in order (%.9g: every float32 round-trips); with --details
// one JSON object per text: {"embedding": [...], "num_tokens": N, "truncated": false}.
// Exit status: 0 done; 1 a server or input error (one line on stderr; the rows of the chunks already
// embedded stay printed); 2 a usage error (a bad or missing option, a malformed --url).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "mbert/triton_embedder.hpp"

namespace {

// Lines of standard input embedded per chunk: one read-embed-print round holds this many texts (the
// library splits a chunk into requests of the model's max_batch_size), so memory stays bounded and
// rows appear while the rest is read.
const std::size_t kChunk = 256;

const char* const kUsage =
    "usage: mbert-embed --url http://HOST:PORT --model NAME [--timeout SECONDS] [--details] [TEXT ...]";

struct Usage {
  std::string message;
};

struct Options {
  std::string url, model;
  double timeout_s = 60.0;
  bool details = false;
  std::vector<std::string> texts;
};

Options parse(int argc, char** argv) {
  Options o;
  bool have_url = false, have_model = false, positional = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (positional || a.empty() || a[0] != '-' || a == "-") {
      o.texts.push_back(a);
      continue;
    }
    if (a == "--") {
      positional = true;
      continue;
    }
    std::string value;
    bool inline_value = false;
    std::size_t eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      inline_value = true;
    }
    auto next = [&]() -> std::string {
      if (inline_value) return value;
      if (i + 1 >= argc) throw Usage{a + " needs a value"};
      return argv[++i];
    };
    if (a == "--url") {
      o.url = next();
      have_url = true;
    } else if (a == "--model") {
      o.model = next();
      have_model = true;
    } else if (a == "--timeout") {
      std::string v = next();
      char* end = nullptr;
      o.timeout_s = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(o.timeout_s > 0) || !std::isfinite(o.timeout_s))
        throw Usage{"--timeout must be a positive number of seconds, got \"" + v + "\""};
    } else if (a == "--details" && !inline_value) {
      o.details = true;
    } else if (a == "-h" || a == "--help") {
      throw Usage{""};
    } else {
      throw Usage{"unknown option " + a};
    }
  }
  if (!have_url) throw Usage{"--url is required"};
  if (!have_model || o.model.empty()) throw Usage{"--model is required"};
  return o;
}

void append_float(std::string& out, float v) {
  char buf[32];
  int n = std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
  out.append(buf, static_cast<std::size_t>(n));
}

// The rows of `e` as JSON lines, written to stdout; false when stdout fails.
bool print(const mbert::Embeddings& e, bool details, std::size_t first_index) {
  std::string out;
  for (std::size_t i = 0; i < e.size(); ++i) {
    const float* row = e.row(i);
    for (std::size_t j = 0; j < e.dim; ++j)
      if (!std::isfinite(row[j]))
        throw mbert::Error(mbert::ErrorKind::MalformedResponse,
                           "text " + std::to_string(first_index + i + 1) + ": the server returned a non-finite value");
    out += details ? "{\"embedding\": [" : "[";
    for (std::size_t j = 0; j < e.dim; ++j) {
      if (j) out += ", ";
      append_float(out, row[j]);
    }
    out += "]";
    if (details)
      out += ", \"num_tokens\": " + std::to_string(e.num_tokens[i]) +
             ", \"truncated\": " + (e.truncated[i] ? "true" : "false") + "}";
    out += "\n";
  }
  return std::fwrite(out.data(), 1, out.size(), stdout) == out.size() && std::fflush(stdout) == 0;
}

struct InputError {
  std::string message;
};

int run(const Options& o) {
  mbert::TritonEmbedder client(o.url, o.model,
                               std::chrono::milliseconds(static_cast<long long>(o.timeout_s * 1000 + 0.5)));
  auto embed = [&](const std::vector<std::string>& texts, std::size_t first) {
    if (!print(client.embed(texts), o.details, first)) throw InputError{"cannot write to standard output"};
  };
  // An empty text is embedded as the runtime and the server embed it ([CLS] [SEP]), so every input
  // line has its output line.
  if (!o.texts.empty()) {
    embed(o.texts, 0);
    return 0;
  }
  std::vector<std::string> chunk;
  std::size_t line_no = 0, done = 0;
  std::string line;
  auto flush = [&]() {
    embed(chunk, done);
    done += chunk.size();
    chunk.clear();
  };
  while (std::getline(std::cin, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    chunk.push_back(line);
    if (chunk.size() == kChunk) flush();
  }
  if (std::cin.bad()) throw InputError{"cannot read standard input"};
  if (!chunk.empty()) flush();
  if (line_no == 0) throw InputError{"no input: no TEXT arguments and standard input is empty"};
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::ios::sync_with_stdio(false);
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const Usage& u) {
    if (u.message.empty()) {
      std::cout << kUsage << "\n\nEmbeds each TEXT (or each line of standard input) through the bundle's ensemble\n"
                   "served by Triton; prints one JSON array of floats per text, in order.\n";
      return 0;
    }
    std::cerr << kUsage << "\nmbert-embed: error: " << u.message << "\n";
    return 2;
  }
  try {
    return run(o);
  } catch (const mbert::Error& e) {
    if (e.kind() == mbert::ErrorKind::InvalidUrl) {
      std::cerr << kUsage << "\nmbert-embed: error: --url: " << e.what() << "\n";
      return 2;
    }
    std::cerr << "mbert-embed: " << e.what() << "\n";
  } catch (const InputError& e) {
    std::cerr << "mbert-embed: " << e.message << "\n";
  } catch (const std::exception& e) {
    std::cerr << "mbert-embed: " << e.what() << "\n";
  }
  return 1;
}
