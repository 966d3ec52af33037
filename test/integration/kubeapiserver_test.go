package integration

// The harness: a real etcd and kube-apiserver on loopback, deploy/'s
// manifests installed in them, ServiceAccount kubeconfigs, and outside
// processes whose logs are shown when a test fails.

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"github.com/apiary-net/apiary/internal/testenv"
)

// repoRoot is the repository, relative to this package's directory (where
// go test runs it).
const repoRoot = "../.."

// requireTestbin returns the paths of kube-apiserver and etcd, or skips
// (fails under APIARY_STRICT=1) when they have not been built.
func requireTestbin(t *testing.T) (apiserver, etcd string) {
	t.Helper()
	bins := testenv.RequireKubeTestbin(t, repoRoot, "kube-apiserver", "etcd")
	return bins["kube-apiserver"], bins["etcd"]
}

// proc is an outside process the test started.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  *testenv.LogBuffer
	done chan struct{} // closed once the process has exited
	err  error         // its exit status, after done
	once sync.Once
	// diesOfSIGTERM: the program ends by re-raising SIGTERM rather than
	// exiting with status 0 (etcd, kube-apiserver), which is clean too.
	diesOfSIGTERM bool
}

// procs is the processes of one test, whose logs are shown if it fails.
type procs struct {
	mu  sync.Mutex
	all []*proc
}

// newProcs returns the process list of t; register it before starting
// anything, so that the logs are shown after every process has stopped.
func newProcs(t *testing.T) *procs {
	ps := &procs{}
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		ps.mu.Lock()
		defer ps.mu.Unlock()
		for _, p := range ps.all {
			lines := 150
			if p.name == "etcd" || p.name == "kube-apiserver" {
				lines = 40
			}
			t.Logf("==== %s: last log lines ====\n%s", p.name, p.log.Tail(lines))
		}
	})
	return ps
}

// start runs path with args until the test ends (or stop is called). The
// process is killed if the test binary dies first (Pdeathsig), so a timed-out
// run leaves no API server behind.
func (ps *procs) start(t *testing.T, name, path string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, cmd: exec.Command(path, args...), log: &testenv.LogBuffer{}, done: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	ps.mu.Lock()
	ps.all = append(ps.all, p)
	ps.mu.Unlock()
	t.Cleanup(func() { p.stop(t) })
	return p
}

// stop sends SIGTERM and waits for the process to exit (SIGKILL after 20 s).
// It reports an unclean exit of a process that was asked to stop.
func (p *proc) stop(t *testing.T) {
	t.Helper()
	p.once.Do(func() {
		select {
		case <-p.done:
			t.Errorf("%s had exited before it was stopped: %v", p.name, p.err)
			return
		default:
		}
		p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
			if p.err != nil && !(p.diesOfSIGTERM && diedOf(p.cmd, syscall.SIGTERM)) {
				t.Errorf("%s did not exit cleanly on SIGTERM: %v", p.name, p.err)
			}
		case <-time.After(20 * time.Second):
			p.cmd.Process.Kill()
			<-p.done
			t.Errorf("%s did not exit within 20s of SIGTERM", p.name)
		}
	})
}

// diedOf reports whether the process was ended by signal sig.
func diedOf(cmd *exec.Cmd, sig syscall.Signal) bool {
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == sig
}

// exited reports whether the process has ended.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// waitLog waits for a JSON log record with message msg and returns the value
// of its attribute attr.
func (p *proc) waitLog(t *testing.T, msg, attr string) string {
	t.Helper()
	var value string
	testenv.Eventually(t, 30*time.Second, p.name+" to log "+strconv.Quote(msg), func() (bool, string) {
		sc := bufio.NewScanner(strings.NewReader(p.log.String()))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var rec map[string]any
			if json.Unmarshal(sc.Bytes(), &rec) == nil && rec["msg"] == msg {
				value, _ = rec[attr].(string)
				return true, ""
			}
		}
		if p.exited() {
			t.Fatalf("%s exited: %v", p.name, p.err)
		}
		return false, "not yet"
	})
	return value
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// cluster is a running etcd and kube-apiserver.
type cluster struct {
	dir    string // working directory: certificates, tokens, kubeconfigs
	server string // https://127.0.0.1:port
	caFile string // the API server's self-signed certificate
	admin  *rest.Config
}

// startCluster starts etcd and kube-apiserver on free loopback ports, with
// token authentication (an admin token in system:masters), RBAC and a
// service account signing key, and waits until /readyz answers 200.
func startCluster(t *testing.T, ps *procs, apiserverBin, etcdBin string, apiserverArgs ...string) *cluster {
	t.Helper()
	// Removed after the processes have stopped (cleanups run last first);
	// etcd preallocates ~123 MB of WAL in it.
	dir := t.TempDir()
	c := &cluster{dir: dir, caFile: filepath.Join(dir, "certs", "apiserver.crt")}

	clientPort, peerPort := freePort(t), freePort(t)
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", clientPort)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	etcd := ps.start(t, "etcd", etcdBin,
		"--name=test", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=test="+peerURL, "--unsafe-no-fsync=true", "--log-level=warn")
	etcd.diesOfSIGTERM = true
	testenv.Eventually(t, 30*time.Second, "etcd /health", func() (bool, string) {
		resp, err := http.Get(etcdURL + "/health")
		if err != nil {
			return false, err.Error()
		}
		defer resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})

	// The service account signing key, for TokenRequest.
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	saKey := filepath.Join(dir, "sa.key")
	writeFile(t, saKey, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}))
	adminToken := rand.Text()
	tokens := filepath.Join(dir, "tokens.csv")
	writeFile(t, tokens, []byte(adminToken+",admin,admin-uid,system:masters\n"))

	port := freePort(t)
	c.server = fmt.Sprintf("https://127.0.0.1:%d", port)
	apiserver := ps.start(t, "kube-apiserver", apiserverBin, append([]string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + filepath.Join(dir, "certs"),
		"--token-auth-file=" + tokens, "--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + saKey, "--service-account-signing-key-file=" + saKey,
		"--service-cluster-ip-range=10.0.0.0/24",
		// No controller manager creates the namespaces' default
		// ServiceAccounts, which this admission plugin would demand of pods.
		"--disable-admission-plugins=ServiceAccount",
		// As in any cluster that runs privileged workloads such as the
		// agent's DaemonSet.
		"--allow-privileged=true",
		// The built-in kubernetes Service's Endpoints cannot hold a
		// loopback address; don't keep trying.
		"--endpoint-reconciler-type=none"},
		// A flag given again wins: callers may change the defaults.
		apiserverArgs...)...)
	apiserver.diesOfSIGTERM = true

	// The certificate is written at start; until it is there, and for the
	// readiness probe, skip verification (nothing else listens there).
	probe := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	testenv.Eventually(t, 60*time.Second, "kube-apiserver /readyz", func() (bool, string) {
		req, _ := http.NewRequest(http.MethodGet, c.server+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+adminToken)
		resp, err := probe.Do(req)
		if err != nil {
			return false, err.Error()
		}
		defer resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})
	c.admin = &rest.Config{Host: c.server, BearerToken: adminToken, TLSClientConfig: rest.TLSClientConfig{CAFile: c.caFile}}
	return c
}

func writeFile(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

// adminClient returns a clientset with the admin token.
func (c *cluster) adminClient(t *testing.T) *kubernetes.Clientset {
	t.Helper()
	cs, err := kubernetes.NewForConfig(c.admin)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

var docSep = regexp.MustCompile(`(?m)^---\s*$`)

// manifest is one object of a file in deploy/.
type manifest struct {
	file string
	obj  *unstructured.Unstructured
}

// readManifests returns the objects of every YAML file in dir, in file
// order.
func readManifests(t *testing.T, dir string) []manifest {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var objs []manifest
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range docSep.Split(string(data), -1) {
			js, err := yaml.YAMLToJSON([]byte(doc))
			if err != nil {
				t.Fatalf("%s, document %d: %v", file, i, err)
			}
			if string(js) == "null" {
				continue // only comments
			}
			u := &unstructured.Unstructured{}
			if err := u.UnmarshalJSON(js); err != nil {
				t.Fatalf("%s, document %d: %v", file, i, err)
			}
			objs = append(objs, manifest{file: filepath.Base(file), obj: u})
		}
	}
	if len(objs) == 0 {
		t.Fatalf("no manifests in %s", dir)
	}
	return objs
}

// install creates every object of deploy/ as kubectl apply would for a new
// cluster: the CRDs first (and waits until they are served), then the rest.
// Creates use strict field validation, so a field the API server does not
// know fails the test as it would fail `kubectl apply`.
func (c *cluster) install(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	dyn, err := dynamic.NewForConfig(c.admin)
	if err != nil {
		t.Fatal(err)
	}
	cs := c.adminClient(t)
	create := func(objs []manifest) {
		groups, err := restmapper.GetAPIGroupResources(cs.Discovery())
		if err != nil {
			t.Fatal(err)
		}
		mapper := restmapper.NewDiscoveryRESTMapper(groups)
		for _, o := range objs {
			u := o.obj
			gvk := u.GroupVersionKind()
			what := fmt.Sprintf("%s %s (%s)", gvk.Kind, u.GetName(), o.file)
			m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
			if err != nil {
				t.Fatalf("install %s: %v", what, err)
			}
			var r dynamic.ResourceInterface = dyn.Resource(m.Resource)
			if m.Scope.Name() == "namespace" {
				r = dyn.Resource(m.Resource).Namespace(u.GetNamespace())
			}
			if _, err := r.Create(ctx, u, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
				t.Fatalf("install %s: %v", what, err)
			}
		}
	}
	crds := readManifests(t, filepath.Join(repoRoot, "deploy/crds"))
	create(crds)
	for _, crd := range crds {
		c.waitEstablished(t, crd.obj.GetName())
	}
	create(readManifests(t, filepath.Join(repoRoot, "deploy")))
}

// crdGVR is the resource of CustomResourceDefinitions.
var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// waitEstablished waits until the CRD called name is Established: its
// resource is served.
func (c *cluster) waitEstablished(t *testing.T, name string) {
	t.Helper()
	dyn, err := dynamic.NewForConfig(c.admin)
	if err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "CRD "+name+" Established", func() (bool, string) {
		u, err := dyn.Resource(crdGVR).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
		for _, cond := range conds {
			m, _ := cond.(map[string]any)
			if m["type"] == "Established" && m["status"] == "True" {
				return true, ""
			}
		}
		return false, fmt.Sprint(conds)
	})
}

// kubeconfig writes a kubeconfig that authenticates as the ServiceAccount
// kube-system/name, with a token from the TokenRequest API, and returns its
// path and a REST config with the same credentials.
func (c *cluster) kubeconfig(t *testing.T, name string) (string, *rest.Config) {
	t.Helper()
	expiry := int64(3600)
	tr, err := c.adminClient(t).CoreV1().ServiceAccounts("kube-system").CreateToken(context.Background(), name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &expiry}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token for ServiceAccount kube-system/%s: %v", name, err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: c.server, CertificateAuthority: c.caFile}
	cfg.AuthInfos[name] = &clientcmdapi.AuthInfo{Token: tr.Status.Token}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: name}
	cfg.CurrentContext = "test"
	path := filepath.Join(c.dir, name+".kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	rc, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		t.Fatal(err)
	}
	return path, rc
}

// startInstalledCluster starts a cluster with deploy/ installed and builds
// the apiary binary meanwhile, returning both.
func startInstalledCluster(t *testing.T, ps *procs, apiserverBin, etcdBin string, apiserverArgs ...string) (*cluster, string) {
	t.Helper()
	// If the test fails while the build runs, its end waits for the
	// build, which would otherwise write into a removed directory.
	var (
		bin      string
		buildErr error
		built    = make(chan struct{})
		binDir   = t.TempDir()
	)
	go func() {
		defer close(built)
		bin, buildErr = buildApiary(binDir)
	}()
	t.Cleanup(func() { <-built })
	c := startCluster(t, ps, apiserverBin, etcdBin, apiserverArgs...)
	c.install(t)
	<-built
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return c, bin
}

// buildApiary builds the apiary binary, as a user would.
func buildApiary(dir string) (string, error) {
	bin := filepath.Join(dir, "apiary")
	cmd := exec.Command("go", "build", "-o", bin, "./daemon")
	cmd.Dir = repoRoot
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./daemon: %w\n%s", err, out)
	}
	return bin, nil
}

// httpGetJSON GETs url and decodes the JSON answer into out.
func httpGetJSON(url string, out any) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// metric returns the value of an unlabelled Prometheus metric at
// http://addr/metrics.
func metric(addr, name string) (float64, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 && f[0] == name {
			return strconv.ParseFloat(f[1], 64)
		}
	}
	return 0, errors.Join(sc.Err(), fmt.Errorf("no metric %s at %s", name, addr))
}
